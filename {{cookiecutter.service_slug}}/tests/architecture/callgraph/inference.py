"""Type inference: what an expression may evaluate to, from annotations (parameters, returns, class
attributes, ``self.x: T``, properties), constructor injection (``self.x = x`` with ``x: T`` in
``__init__``), assignments, calls (constructors, returns, dependency-injector providers) and
``uow.repository(Port)``, resolved through the port -> adapter map the composition root uses."""

from __future__ import annotations

import ast
import builtins
import inspect

from .runtime import _runtime_return, classify, runtime_object
from .scopes import Scope
from .sources import FunctionSource, _dotted
from .values import (
    BUILDING_PROVIDERS,
    CONTEXT_MANAGERS,
    ITERATORS,
    MISSING,
    PROPERTIES,
    SESSION_FACTORIES,
    TYPING_MODULES,
    WRAPPERS,
    ClassRef,
    External,
    FunctionRef,
    Instance,
    ModuleRef,
    Provider,
    Value,
)


class Inference:
    """The inference part of :class:`CallGraph` (its state lives there)."""

    def infer(self, expr: ast.expr, scope: Scope) -> set[Value]:
        """The values an expression can have (empty when unknown)."""
        inferrer = self._inferrers.get(type(expr))
        return inferrer(expr, scope) if inferrer is not None else set()

    def _infer_attribute(self, expr: ast.Attribute, scope: Scope) -> set[Value]:
        return {v for value in self.infer(expr.value, scope) for v in self.attribute(value, expr.attr)}

    def _infer_lambda(self, expr: ast.Lambda, _scope: Scope) -> set[Value]:
        return {FunctionRef(self.index.function_nodes[id(expr)].key)}

    def _infer_call(self, call: ast.Call, scope: Scope) -> set[Value]:
        ports = self._ports(call, scope)
        if ports:
            return {v for port in ports for v in self.adapted(port)}
        return {v for callee in self.infer(call.func, scope) for v in self._call_result(callee, call, scope)}

    def _ports(self, call: ast.Call, scope: Scope) -> list[str]:
        """The Protocol classes of a ``uow.repository(Port)`` call (empty for other calls)."""
        if not (
            isinstance(call.func, ast.Attribute) and call.func.attr in self.resolver_methods and call.args
        ):
            return []
        return [v.type for v in self.infer(call.args[0], scope) if isinstance(v, ClassRef)]

    def adapted(self, port: str) -> set[Value]:
        """What ``uow.repository(port)`` returns: the mapped adapter, else the port itself."""
        adapters = self._adapters.get(port)
        if adapters is None:
            return {Instance(port)}
        found: set[Value] = set()
        for adapter in adapters:
            if isinstance(adapter, ClassRef):
                found.add(Instance(adapter.type))
            elif isinstance(adapter, FunctionRef):
                found |= self.returns(self.index.functions[adapter.key])
        return found

    def _call_result(self, callee: Value, call: ast.Call, scope: Scope) -> set[Value]:
        """What calling ``callee`` gives (``functools.partial(f, ...)`` gives ``f`` itself)."""
        if isinstance(callee, ClassRef):
            if callee.type in BUILDING_PROVIDERS and call.args:
                return {Provider(frozenset(self.infer(call.args[0], scope)))}
            partial = callee.type == "functools.partial" and call.args
            return self.infer(call.args[0], scope) if partial else {Instance(callee.type)}
        if isinstance(callee, Provider):
            return {v for built in callee.provides for v in self._built_by(built)}
        if isinstance(callee, FunctionRef):
            fn = self.index.functions.get(callee.key)
            return self.returns(fn) if fn is not None else set()
        if isinstance(callee, Instance):
            return self._call_instance(callee)
        if isinstance(callee, External):
            if callee.name == "typing.cast" and call.args:
                return self.annotation(call.args[0], scope)
            return _runtime_return(runtime_object(callee.name))
        return set()

    def _built_by(self, built: Value) -> set[Value]:
        """What a provider hands out when called: an instance of its class, or what its
        function returns."""
        if isinstance(built, ClassRef):
            return {Instance(built.type)}
        if isinstance(built, FunctionRef):
            fn = self.index.functions.get(built.key)
            return self.returns(fn) if fn is not None else set()
        if isinstance(built, External):
            return _runtime_return(runtime_object(built.name))
        return set()

    def _call_instance(self, callee: Instance) -> set[Value]:
        method = self.find_method(callee.type, "__call__")
        if method is not None:
            return self.returns(method)
        made = SESSION_FACTORIES.get(callee.type)
        return {Instance(made)} if made else set()

    def returns(self, fn: FunctionSource) -> set[Value]:
        """What calling ``fn`` gives: its return annotation (a context manager's yielded type),
        or a lambda's body."""
        scope = self.scope_of(fn)
        if isinstance(fn.node, ast.Lambda):
            return self.infer(fn.node.body, scope)
        if fn.decorators & PROPERTIES or not fn.decorators & CONTEXT_MANAGERS:
            return self.annotation(fn.node.returns, scope)
        returns = fn.node.returns
        if isinstance(returns, ast.Subscript) and self.typing_name(returns.value, scope) in ITERATORS:
            first = returns.slice.elts[0] if isinstance(returns.slice, ast.Tuple) else returns.slice
            return self.annotation(first, scope)
        return self.annotation(returns, scope)

    def attribute(self, value: Value, attr: str) -> set[Value]:
        """``value.attr``: a module member, a class member, an instance attribute (a property
        gives its return type) or a library attribute."""
        if isinstance(value, ModuleRef):
            if f"{value.name}.{attr}" in self.index.modules:
                return {ModuleRef(f"{value.name}.{attr}")}
            module = self.index.modules.get(value.name)
            if module is not None:
                return self._global(module, attr)
            return classify(runtime_object(f"{value.name}.{attr}"))
        if isinstance(value, Instance | ClassRef):
            if value.type in self.index.classes:
                return self._member(value, attr)
            return self._library_member(value, attr)
        return set()

    def _member(self, value: Instance | ClassRef, attr: str) -> set[Value]:
        for cls in self.mro(value.type):
            if attr in cls.methods:
                fn = cls.methods[attr]
                if isinstance(value, Instance) and fn.decorators & PROPERTIES:
                    return self.returns(fn)
                return {FunctionRef(fn.key)}
            if attr in cls.nested:
                return {ClassRef(cls.nested[attr])}
            attrs = self.attributes(cls)
            if attr in attrs:
                return attrs[attr]
        for base in self.ancestors(value.type):
            if base not in self.index.classes:
                found = self._library_member(type(value)(base), attr)
                if found:
                    return found
        return set()

    def _library_member(self, value: Instance | ClassRef, attr: str) -> set[Value]:
        cls = runtime_object(value.type)
        if not inspect.isclass(cls):
            return set()
        if isinstance(value, ClassRef):
            return classify(getattr(cls, attr, MISSING))
        static = inspect.getattr_static(cls, attr, MISSING)
        if isinstance(static, property):
            return _runtime_return(static.fget)
        if callable(static):
            return {External(self.library_method(value.type, attr))}
        return set()

    def library_method(self, type_: str, method: str) -> str:
        """The canonical name of a library method (where it is defined, not where looked up)."""
        found = getattr(runtime_object(type_), method, None)
        module, qualname = getattr(found, "__module__", None), getattr(found, "__qualname__", None)
        return f"{module}.{qualname}" if module and qualname else f"{type_}.{method}"

    def typing_name(self, expr: ast.expr, scope: Scope) -> str | None:
        """``Optional``, ``type``, ``Self``...: the bare name of a typing construct, else None."""
        dotted = _dotted(expr)
        if dotted is None:
            return None
        head, _, rest = dotted.partition(".")
        if head in scope.module.imports:
            qualified = scope.module.imports[head] + (f".{rest}" if rest else "")
        elif not rest and head not in scope.module.defs and hasattr(builtins, head):
            qualified = f"builtins.{head}"
        else:
            return None
        module, _, name = qualified.rpartition(".")
        return name if module in TYPING_MODULES else None

    def annotation(self, expr: ast.expr | None, scope: Scope) -> set[Value]:
        """The instances an annotation describes (``A | None`` -> A, ``type[A]`` -> class A)."""
        if expr is None:
            return set()
        if isinstance(expr, ast.Constant):
            return self._string_annotation(expr.value, scope)
        if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.BitOr):
            return self.annotation(expr.left, scope) | self.annotation(expr.right, scope)
        if isinstance(expr, ast.Subscript):
            return self._generic_annotation(expr, scope)
        if self.typing_name(expr, scope) == "Self":
            return {Instance(scope.owner.key)} if scope.owner is not None else set()
        return {Instance(v.type) for v in self.infer(expr, scope) if isinstance(v, ClassRef)}

    def _string_annotation(self, text: object, scope: Scope) -> set[Value]:
        if not isinstance(text, str):
            return set()
        try:
            parsed = ast.parse(text, mode="eval").body
        except SyntaxError:
            return set()
        return self.annotation(parsed, scope)

    def _generic_annotation(self, expr: ast.Subscript, scope: Scope) -> set[Value]:
        name = self.typing_name(expr.value, scope)
        args = list(expr.slice.elts) if isinstance(expr.slice, ast.Tuple) else [expr.slice]
        if name in {"Optional", "Union"}:
            return {v for arg in args for v in self.annotation(arg, scope)}
        if name in WRAPPERS:
            return self.annotation(args[0], scope)
        if name in {"type", "Type"}:
            return {ClassRef(v.type) for v in self.annotation(args[0], scope) if isinstance(v, Instance)}
        return self.annotation(expr.value, scope)
