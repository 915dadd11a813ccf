"""Class hierarchy over the scanned source: bases, the MRO, ancestors, subclasses, the implementers
of a method name, virtual dispatch (interface calls expanded to their implementations) and the
attributes a class assigns."""

from __future__ import annotations

import ast
import inspect
from collections import defaultdict

from .runtime import runtime_object
from .scopes import Scope, _self_attribute, own_nodes
from .sources import ClassSource, FunctionSource
from .values import PROTOCOL_TYPES, ClassRef, Value, type_name


class Hierarchy:
    """The class hierarchy part of :class:`CallGraph` (its state lives there)."""

    def bases(self, cls: ClassSource) -> list[str]:
        if cls.key not in self._bases:
            self._bases[cls.key] = []
            scope = Scope(cls.module)
            found: list[str] = []
            for base in cls.node.bases:
                expr = base.value if isinstance(base, ast.Subscript) else base
                found += [v.type for v in self.infer(expr, scope) if isinstance(v, ClassRef)]
            self._bases[cls.key] = found
        return self._bases[cls.key]

    def is_protocol(self, cls: ClassSource) -> bool:
        return any(base in PROTOCOL_TYPES for base in self.bases(cls))

    def mro(self, type_: str) -> list[ClassSource]:
        """Scanned classes in lookup order (depth first, left to right, each once)."""
        if type_ not in self._mro:
            order: list[ClassSource] = []
            self._mro[type_] = order
            pending = [type_]
            while pending:
                cls = self.index.classes.get(pending.pop(0))
                if cls is not None and cls not in order:
                    order.append(cls)
                    pending[:0] = self.bases(cls)
        return self._mro[type_]

    def ancestors(self, type_: str) -> frozenset[str]:
        """The type and every base, scanned or not (libraries via their ``__mro__``)."""
        if type_ in self._ancestors:
            return self._ancestors[type_]
        self._ancestors[type_] = frozenset({type_})
        cls = self.index.classes.get(type_)
        if cls is not None:
            found = {type_}.union(*(self.ancestors(base) for base in self.bases(cls)))
        else:
            obj = runtime_object(type_)
            found = {type_name(c) for c in obj.__mro__} | {type_} if inspect.isclass(obj) else {type_}
        self._ancestors[type_] = frozenset(found)
        return self._ancestors[type_]

    def find_method(self, type_: str, name: str) -> FunctionSource | None:
        for cls in self.mro(type_):
            if name in cls.methods:
                return cls.methods[name]
        return None

    def subclasses(self, type_: str) -> list[str]:
        self._refresh()
        if self._subclasses is None:
            direct: dict[str, set[str]] = defaultdict(set)
            for cls in list(self.index.classes.values()):
                for base in self.bases(cls):
                    direct[base].add(cls.key)
            self._subclasses = direct
        found: list[str] = []
        pending = sorted(self._subclasses.get(type_, ()))
        while pending:
            key = pending.pop(0)
            if key not in found:
                found.append(key)
                pending += sorted(self._subclasses.get(key, ()))
        return found

    def implementers(self, method: str) -> list[FunctionSource]:
        """Every scanned non-Protocol class's own definition of ``method``: what a call through a
        Protocol can reach, structurally (no base class needed; over-approximates)."""
        self._refresh()
        if method not in self._implementers:
            self._implementers[method] = [
                cls.methods[method]
                for cls in list(self.index.classes.values())
                if method in cls.methods and not self.is_protocol(cls)
            ]
        return self._implementers[method]

    def dispatch(self, type_: str, method: str) -> list[FunctionSource]:
        """Every implementation a call ``obj.method()`` on a ``type_`` can run: the type's own
        (by lookup), every scanned subclass's override (virtual and ABC dispatch, nominal) and,
        for a Protocol, every scanned class that defines the method (structural)."""
        cls = self.index.classes.get(type_)
        if cls is None:
            return []
        found: list[FunctionSource] = []
        for key in [type_, *self.subclasses(type_)]:
            candidate = self.index.classes[key]
            fn = None if self.is_protocol(candidate) else self.find_method(key, method)
            if fn is not None and fn not in found:
                found.append(fn)
        if self.is_protocol(cls):
            found += [fn for fn in self.implementers(method) if fn not in found]
        return found

    def attributes(self, cls: ClassSource) -> dict[str, set[Value]]:
        """A class's own attributes: class-body annotations/assignments and ``self.x`` ones."""
        if cls.key in self._attrs:
            return self._attrs[cls.key]
        attrs: dict[str, set[Value]] = defaultdict(set)
        self._attrs[cls.key] = attrs
        class_scope = Scope(cls.module, None, cls)
        for stmt in cls.node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                attrs[stmt.target.id] |= self.annotation(stmt.annotation, class_scope)
            elif isinstance(stmt, ast.Assign):
                values = self.infer(stmt.value, class_scope)
                for target in stmt.targets:
                    if isinstance(target, ast.Name):
                        attrs[target.id] |= values
        for method in cls.methods.values():
            self._collect_self_attributes(method, attrs)
        return attrs

    def _collect_self_attributes(self, method: FunctionSource, attrs: dict[str, set[Value]]) -> None:
        params = [*method.node.args.posonlyargs, *method.node.args.args]
        if not params or method.decorators & {"staticmethod", "classmethod"}:
            return
        self_name = params[0].arg
        scope = self.scope_of(method)
        for node in own_nodes(method.node):
            if isinstance(node, ast.AnnAssign) and (name := _self_attribute(node.target, self_name)):
                attrs[name] |= self.annotation(node.annotation, scope)
                attrs[name] |= self.infer(node.value, scope) if node.value else set()
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    if name := _self_attribute(target, self_name):
                        attrs[name] |= self.infer(node.value, scope)
