"""The call graph: ``CallGraph.edges(function)`` lists what one function can reach (calls,
references, context managers entered), each target resolved by the inference; the rules that
walk it (``save_rule``) state their limits."""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from .environment import Environment
from .hierarchy import Hierarchy
from .inference import Inference
from .scopes import Callee, Edge, Scope, _dedupe, _underlying_function, own_nodes
from .sources import ClassSource, FunctionSource, SourceIndex
from .values import (
    PROPERTIES,
    ClassRef,
    External,
    FunctionRef,
    Instance,
    ModuleRef,
    Provider,
    Value,
    type_name,
)


class CallGraph(Inference, Environment, Hierarchy):
    """Type inference and call resolution over a :class:`SourceIndex`."""

    def __init__(
        self,
        index: SourceIndex,
        *,
        adapters: Mapping[type[Any], Callable[..., Any]] | None = None,
        resolver_methods: Iterable[str] = ("repository",),
    ) -> None:
        self.index = index
        self.resolver_methods = frozenset(resolver_methods)
        self._envs: dict[str, dict[str, set[Value]]] = {}
        self._attrs: dict[str, dict[str, set[Value]]] = {}
        self._globals: dict[tuple[str, str], set[Value]] = {}
        self._resolved: dict[str, set[Value]] = {}
        self._edges: dict[str, tuple[Edge, ...]] = {}
        self._bases: dict[str, list[str]] = {}
        self._ancestors: dict[str, frozenset[str]] = {}
        self._mro: dict[str, list[ClassSource]] = {}
        self._implementers: dict[str, list[FunctionSource]] = {}
        self._subclasses: dict[str, set[str]] | None = None
        self._version = index.version
        self._inferrers: dict[type[ast.AST], Callable[[Any, Scope], set[Value]]] = {
            ast.Name: lambda e, s: self.lookup(e.id, s),
            ast.Attribute: self._infer_attribute,
            ast.Call: self._infer_call,
            ast.Await: lambda e, s: self.infer(e.value, s),
            ast.NamedExpr: lambda e, s: self.infer(e.value, s),
            ast.Lambda: self._infer_lambda,
            ast.IfExp: lambda e, s: self.infer(e.body, s) | self.infer(e.orelse, s),
            ast.BoolOp: lambda e, s: {v for value in e.values for v in self.infer(value, s)},
        }
        self._adapters: dict[str, set[Value]] = {}
        for port, adapter in (adapters or {}).items():
            self._adapters.setdefault(type_name(port), set()).update(self._values_of(adapter))

    def function_for(self, obj: object) -> FunctionSource | None:
        """The source of a registered callable: function, lambda, bound method, partial or an
        object with ``__call__``."""
        target = _underlying_function(obj)
        if target is None:
            return None
        code = target.__code__
        path = Path(code.co_filename).resolve()
        self.index.add_module(target.__module__, path, is_package=path.name == "__init__.py")
        self._refresh()
        fn = self.index.functions.get(f"{target.__module__}.{target.__qualname__}")
        if fn is not None and fn.module.path == path:
            return fn
        for candidate in self.index.by_location.get((path, code.co_firstlineno), []):
            if candidate.name in (target.__name__, "<lambda>"):
                return candidate
        return None

    def _values_of(self, obj: object) -> set[Value]:
        if inspect.isclass(obj):
            return {ClassRef(type_name(obj))}
        fn = self.function_for(obj)
        return {FunctionRef(fn.key)} if fn is not None else set()

    def _refresh(self) -> None:
        if self._version != self.index.version:
            self._version = self.index.version
            self._subclasses = None
            self._implementers.clear()

    def edges(self, fn: FunctionSource) -> tuple[Edge, ...]:
        """Everything ``fn`` can reach in one step, each with the line it happens on."""
        if fn.key not in self._edges:
            scope = self.scope_of(fn)
            nodes = list(own_nodes(fn.node))
            called = {id(node.func) for node in nodes if isinstance(node, ast.Call)}
            found: list[Edge] = []
            for node in nodes:
                found += self._edges_of(node, scope, called)
            self._edges[fn.key] = tuple(dict.fromkeys(found))
        return self._edges[fn.key]

    def _edges_of(self, node: ast.AST, scope: Scope, called: set[int]) -> list[Edge]:
        if isinstance(node, ast.Call):
            return [Edge(c, node.lineno, "calls") for c in self.call_targets(node, scope)]
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            nested = self.index.function_nodes[id(node)]
            return [Edge(Callee(nested.key, nested), node.lineno, "defines")]
        if (
            isinstance(node, ast.Name | ast.Attribute)
            and isinstance(node.ctx, ast.Load)
            and id(node) not in called
        ):
            return self._reference_edges(node, scope)
        if isinstance(node, ast.With | ast.AsyncWith):
            return self._enter_edges(node, scope)
        return []

    def _reference_edges(self, node: ast.Name | ast.Attribute, scope: Scope) -> list[Edge]:
        found: list[Edge] = []
        if isinstance(node, ast.Attribute):
            for receiver in self.infer(node.value, scope):
                if isinstance(receiver, Instance):
                    getter = self.find_method(receiver.type, node.attr)
                    if getter is not None and getter.decorators & PROPERTIES:
                        callee = Callee(getter.key, getter, receiver.type, node.attr)
                        found.append(Edge(callee, node.lineno, "reads"))
        for value in self.infer(node, scope):
            if isinstance(value, FunctionRef | External):
                found += [Edge(c, node.lineno, "passes") for c in self._value_callees(value)]
        return found

    def _enter_edges(self, node: ast.With | ast.AsyncWith, scope: Scope) -> list[Edge]:
        names = ("__aenter__", "__aexit__") if isinstance(node, ast.AsyncWith) else ("__enter__", "__exit__")
        found: list[Edge] = []
        for item in node.items:
            for value in self.infer(item.context_expr, scope):
                if isinstance(value, Instance):
                    found += [
                        Edge(Callee(fn.key, fn, value.type, name), node.lineno, "enters")
                        for name in names
                        for fn in self.dispatch(value.type, name)
                    ]
        return found

    def call_targets(self, call: ast.Call, scope: Scope) -> list[Callee]:
        """What a call can run. A method on a receiver of unknown type is reported ``untyped``."""
        func = call.func
        adapters = [c for port in self._ports(call, scope) for c in self._adapter_callees(port)]
        if isinstance(func, ast.Attribute):
            receivers = self.infer(func.value, scope)
            if not receivers:
                return [Callee(f"?.{func.attr}", method=func.attr, untyped=True), *adapters]
            return _dedupe([*(c for r in receivers for c in self._method_callees(r, func.attr)), *adapters])
        return _dedupe(c for value in self.infer(func, scope) for c in self._value_callees(value))

    def _adapter_callees(self, port: str) -> list[Callee]:
        """``uow.repository(Port)`` builds the adapter: its constructor is reachable too."""
        return [c for adapter in self._adapters.get(port, ()) for c in self._value_callees(adapter)]

    def _method_callees(self, receiver: Value, method: str) -> list[Callee]:
        if isinstance(receiver, Instance | ClassRef):
            type_ = receiver.type
            if type_ not in self.index.classes:
                return [Callee(self.library_method(type_, method), None, type_, method)]
            implementations = self.dispatch(type_, method)
            if implementations:
                return [Callee(fn.key, fn, type_, method) for fn in implementations]
            held = [c for v in self.attribute(receiver, method) for c in self._value_callees(v)]
            return held or [Callee(f"{type_}.{method}", None, type_, method)]
        if isinstance(receiver, ModuleRef):
            members = self.attribute(receiver, method)
            return [c for v in members for c in self._value_callees(v)] or [
                Callee(f"{receiver.name}.{method}")
            ]
        return []

    def _value_callees(self, value: Value) -> list[Callee]:
        if isinstance(value, FunctionRef):
            return [Callee(value.key, self.index.functions.get(value.key))]
        if isinstance(value, ClassRef):
            if value.type not in self.index.classes:
                return [Callee(value.type, None, value.type, "__init__")]
            constructors = [self.find_method(value.type, name) for name in ("__init__", "__post_init__")]
            return [Callee(fn.key, fn, value.type, fn.name) for fn in constructors if fn is not None]
        if isinstance(value, Instance):
            return self._method_callees(value, "__call__")
        if isinstance(value, External):
            return [Callee(value.name)]
        if isinstance(value, Provider):
            return [c for built in value.provides for c in self._value_callees(built)]
        return []
