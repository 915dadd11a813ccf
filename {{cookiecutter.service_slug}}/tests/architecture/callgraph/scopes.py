"""Scopes, the edges of the graph (``Edge.how``) and the callees a call can reach, with the small
``ast`` helpers the inference shares."""

from __future__ import annotations

import ast
import functools
import inspect
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from .sources import ClassSource, FunctionSource, ModuleSource
from .values import SCOPE_NODES, FunctionNode, Value


@dataclass(frozen=True)
class Scope:
    module: ModuleSource
    function: FunctionSource | None = None
    owner: ClassSource | None = None


@dataclass(frozen=True)
class Callee:
    """What one call site (or reference) can reach.

    ``name`` is the function's key for scanned code and the canonical dotted name otherwise;
    ``receiver`` is the type the method was looked up on (for ``(type, method)`` sinks);
    ``untyped`` marks a method called on a receiver whose type is unknown.
    """

    name: str
    function: FunctionSource | None = None
    receiver: str | None = None
    method: str | None = None
    untyped: bool = False


@dataclass(frozen=True)
class Edge:
    """``how``: calls, defines (a nested def/lambda), passes (a function used as a value),
    reads (a property), enters (``with``: ``__enter__``/``__aenter__`` and the exits)."""

    callee: Callee
    line: int
    how: str


def own_nodes(root: FunctionNode) -> Iterator[ast.AST]:
    """The nodes of a function's body in source order, not entering nested scopes (whose
    decorators and defaults, evaluated here, are included)."""
    stack: list[ast.AST] = [root.body] if isinstance(root, ast.Lambda) else list(reversed(root.body))
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, SCOPE_NODES):
            stack.extend(reversed(_evaluated_in_enclosing_scope(node)))
            continue
        stack.extend(reversed(list(ast.iter_child_nodes(node))))


def _evaluated_in_enclosing_scope(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.ClassDef):
        return [*node.decorator_list, *node.bases, *(k.value for k in node.keywords)]
    if isinstance(node, ast.Lambda):
        return [*node.args.defaults, *(d for d in node.args.kw_defaults if d)]
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return [*node.decorator_list, *node.args.defaults, *(d for d in node.args.kw_defaults if d)]
    return []


def _self_attribute(target: ast.expr, self_name: str | None) -> str | None:
    if (
        self_name is not None
        and isinstance(target, ast.Attribute)
        and isinstance(target.value, ast.Name)
        and target.value.id == self_name
    ):
        return target.attr
    return None


def _dedupe(callees: Iterable[Callee]) -> list[Callee]:
    return list(dict.fromkeys(callees))


def _bind_target(target: ast.expr, values: set[Value], env: dict[str, set[Value]]) -> None:
    if isinstance(target, ast.Name):
        env.setdefault(target.id, set()).update(values)
    elif isinstance(target, ast.Tuple | ast.List | ast.Starred):
        elements = target.elts if isinstance(target, ast.Tuple | ast.List) else [target.value]
        for element in elements:
            _bind_target(element, set(), env)


def _underlying_function(obj: object) -> Any:
    """The plain function behind a handler (partials, wrappers, bound methods, ``__call__``)."""
    target: Any = obj
    while isinstance(target, functools.partial):
        target = target.func
    target = inspect.unwrap(target) if callable(target) else target
    if inspect.ismethod(target):
        target = target.__func__
    if inspect.isclass(target):
        target = target.__init__
    elif not inspect.isfunction(target) and callable(target):
        target = getattr(type(target).__call__, "__func__", type(target).__call__)
    return target if inspect.isfunction(target) else None
