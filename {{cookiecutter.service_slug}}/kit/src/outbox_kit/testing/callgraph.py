"""A static call graph over Python source, for the architecture rules: type inference and
call resolution over a :class:`SourceIndex` (the class hierarchy, the names a scope holds,
what an expression may be, and the edges out of a function).

Class hierarchy over the scanned source: bases, the MRO, ancestors, subclasses, the implementers
of a method name, virtual dispatch (interface calls expanded to their implementations) and the
attributes a class assigns.

Names and what they may hold: module globals, resolved dotted names, and the flow-insensitive
environment of a function (parameters from annotations, assignments, ``with``/``async with``
targets, nested definitions): a name holds the union of every value assigned to it in its scope,
which over-approximates, never under-.

Type inference: what an expression may evaluate to, from annotations (parameters, returns, class
attributes, ``self.x: T``, properties), constructor injection (``self.x = x`` with ``x: T`` in
``__init__``), assignments, calls (constructors, returns, dependency-injector providers) and
``uow.repository(Port)``, resolved through the port -> adapter map the composition root uses.

The call graph: ``CallGraph.edges(function)`` lists what one function can reach (calls,
references, context managers entered), each target resolved by the inference; the rules that
walk it (``rules``) state their limits.

What it reads: What the call graph reads: the scanned packages' source (modules, classes, functions), the
values a name can hold, scopes and edges, and the few facts taken from the running process.

What the call graph reasons about: a value is an instance of a class, a class, a module, a
function of the scanned source (lambdas and nested functions included), an external callable or
a dependency-injector provider; and the names of the library types it recognises.

The scanned packages, parsed with ``ast``: modules, classes and functions (lambdas and nested
functions included) with their imports and top-level names. Nothing here runs the code it reads.

Scopes, the edges of the graph (``Edge.how``) and the callees a call can reach, with the small
``ast`` helpers the inference shares.

The one place the analysis looks at live objects: a name that leads outside the scanned packages
(sqlalchemy's ``AsyncSession``, ``functools.partial``) is looked up on the imported library, to
learn its canonical name, its base classes and what it returns."""

from __future__ import annotations

import ast
import builtins
import functools
import importlib.util
import inspect
import sys
import types
import typing
from collections import abc, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda

SCOPE_NODES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)

TYPING_MODULES = frozenset({"typing", "typing_extensions", "collections.abc", "builtins"})

PROTOCOL_TYPES = frozenset({"typing.Protocol", "typing_extensions.Protocol"})

CONTEXT_MANAGERS = frozenset({"contextmanager", "asynccontextmanager"})

PROPERTIES = frozenset({"property", "cached_property"})

ITERATORS = frozenset({"Iterator", "AsyncIterator", "Generator", "AsyncGenerator"})

WRAPPERS = frozenset({"Annotated", "ClassVar", "Final", "Required", "NotRequired", "ReadOnly"})

# Calling a session factory gives a session (``Database.sessions()``).
SESSION_FACTORIES = {
    "sqlalchemy.orm.session.sessionmaker": "sqlalchemy.orm.session.Session",
    "sqlalchemy.ext.asyncio.session.async_sessionmaker": "sqlalchemy.ext.asyncio.session.AsyncSession",
}

# dependency-injector providers that build by calling their first argument.
BUILDING_PROVIDERS = frozenset(
    f"dependency_injector.providers.{name}"
    for name in (
        "Factory",
        "Singleton",
        "ThreadSafeSingleton",
        "ThreadLocalSingleton",
        "ContextLocalSingleton",
        "Callable",
        "Coroutine",
        "Resource",
    )
)

ITERATOR_ORIGINS = (abc.Iterator, abc.AsyncIterator, abc.Generator, abc.AsyncGenerator)

MISSING = object()


@dataclass(frozen=True)
class Instance:
    type: str


@dataclass(frozen=True)
class ClassRef:
    type: str


@dataclass(frozen=True)
class ModuleRef:
    name: str


@dataclass(frozen=True)
class FunctionRef:
    key: str


@dataclass(frozen=True)
class External:
    """A callable outside the scanned packages, by its canonical dotted name."""

    name: str


@dataclass(frozen=True)
class Provider:
    """A dependency-injector provider (``providers.Factory(X, ...)``) and what calling it
    builds: a class (its constructor runs, an instance comes back) or a function."""

    provides: frozenset[Value]


Value = Instance | ClassRef | ModuleRef | FunctionRef | External | Provider


def type_name(cls: type[Any]) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclass(eq=False)
class ModuleSource:
    name: str
    path: Path
    tree: ast.Module
    is_package: bool
    imports: dict[str, str] = field(default_factory=dict)
    defs: dict[str, str] = field(default_factory=dict)
    assigns: dict[str, list[ast.expr]] = field(default_factory=lambda: defaultdict(list))


@dataclass(eq=False)
class ClassSource:
    key: str
    module: ModuleSource
    node: ast.ClassDef
    methods: dict[str, FunctionSource] = field(default_factory=dict)
    nested: dict[str, str] = field(default_factory=dict)


@dataclass(eq=False)
class FunctionSource:
    key: str
    module: ModuleSource
    node: FunctionNode
    owner: ClassSource | None
    parent: FunctionSource | None

    @property
    def name(self) -> str:
        return "<lambda>" if isinstance(self.node, ast.Lambda) else self.node.name

    @property
    def line(self) -> int:
        return self.node.lineno

    @property
    def decorators(self) -> frozenset[str]:
        if isinstance(self.node, ast.Lambda):
            return frozenset()
        return frozenset(_last_name(d) for d in self.node.decorator_list)


def _last_name(expr: ast.expr) -> str:
    if isinstance(expr, ast.Call):
        return _last_name(expr.func)
    if isinstance(expr, ast.Attribute):
        return expr.attr
    return expr.id if isinstance(expr, ast.Name) else ""


def _dotted(expr: ast.expr) -> str | None:
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        base = _dotted(expr.value)
        return None if base is None else f"{base}.{expr.attr}"
    return None


def _import_base(module: ModuleSource, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.name if module.is_package else module.name.rpartition(".")[0]
    parts = package.split(".")
    parts = parts[: len(parts) - (node.level - 1)]
    base = ".".join(parts)
    return f"{base}.{node.module}" if node.module else base


def _collect_imports(module: ModuleSource) -> None:
    """Every import of the module, function-local and TYPE_CHECKING ones included."""
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                module.imports[alias.asname or top] = alias.name if alias.asname else top
        elif isinstance(node, ast.ImportFrom):
            base = _import_base(module, node)
            for alias in node.names:
                if alias.name != "*":
                    module.imports[alias.asname or alias.name] = f"{base}.{alias.name}".lstrip(".")


def _collect_top_level(module: ModuleSource, body: list[ast.stmt]) -> None:
    for stmt in body:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            module.defs[stmt.name] = f"{module.name}.{stmt.name}"
        elif isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                if isinstance(target, ast.Name):
                    module.assigns[target.id].append(stmt.value)
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value:
            module.assigns[stmt.target.id].append(stmt.value)
        elif isinstance(stmt, ast.If | ast.Try):
            _collect_top_level(module, [*stmt.body, *stmt.orelse])


class _Indexer(ast.NodeVisitor):
    """Gives every class, function and lambda of one module its dotted key."""

    def __init__(self, index: SourceIndex, module: ModuleSource) -> None:
        self.index = index
        self.module = module
        self.prefix = [module.name]
        self.class_body: ClassSource | None = None
        self.function: FunctionSource | None = None

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        cls = ClassSource(".".join([*self.prefix, node.name]), self.module, node)
        self.index.classes.setdefault(cls.key, cls)
        self.index.class_nodes[id(node)] = cls
        if self.class_body is not None:
            self.class_body.nested[node.name] = cls.key
        saved = (self.prefix, self.class_body)
        self.prefix, self.class_body = [*self.prefix, node.name], cls
        self.generic_visit(node)
        self.prefix, self.class_body = saved

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._function(node, node.name)

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self._function(node, node.name)

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self._function(node, f"<lambda>@{node.lineno}:{node.col_offset}")

    def _function(self, node: FunctionNode, name: str) -> None:
        fn = FunctionSource(".".join([*self.prefix, name]), self.module, node, self.class_body, self.function)
        self.index.add_function(fn)
        if self.class_body is not None and not isinstance(node, ast.Lambda):
            self.class_body.methods.setdefault(node.name, fn)
        saved = (self.prefix, self.class_body, self.function)
        self.prefix = (
            [*self.prefix, name] if isinstance(node, ast.Lambda) else [*self.prefix, name, "<locals>"]
        )
        self.class_body, self.function = None, fn
        self.generic_visit(node)
        self.prefix, self.class_body, self.function = saved


# The kit's test tooling is not code a handler of a service reaches: left out of the index, so a
# name resolved by its method (``enqueue``, ``commit``) never lands on a test double's. A module
# of it is still read when a handler lives there (the kit's own tests).
TEST_TOOLING = "outbox_kit.testing"


def _package_files(package: str) -> Iterator[tuple[str, Path, bool]]:
    spec = importlib.util.find_spec(package)
    if spec is None or (spec.origin is None and not spec.submodule_search_locations):
        raise ModuleNotFoundError(package)
    if not spec.submodule_search_locations:
        yield package, Path(str(spec.origin)), False
        return
    for root in spec.submodule_search_locations:
        for path in sorted(Path(root).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            yield ".".join([package, *(parts[:-1] if is_package else parts)]), path, is_package


class SourceIndex:
    """The parsed source of some packages (and of any module a handler lives in)."""

    def __init__(self, packages: Iterable[str]) -> None:
        self.packages = tuple(packages)
        self.modules: dict[str, ModuleSource] = {}
        self.classes: dict[str, ClassSource] = {}
        self.functions: dict[str, FunctionSource] = {}
        self.by_location: dict[tuple[Path, int], list[FunctionSource]] = defaultdict(list)
        self.function_nodes: dict[int, FunctionSource] = {}
        self.class_nodes: dict[int, ClassSource] = {}
        self.version = 0
        for package in self.packages:
            for name, path, is_package in _package_files(package):
                if name == TEST_TOOLING or name.startswith(f"{TEST_TOOLING}."):
                    continue
                self.add_module(name, path, is_package=is_package)

    def add_module(self, name: str, path: Path, *, is_package: bool = False) -> ModuleSource | None:
        known = self.modules.get(name)
        if known is not None:
            return known
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except (OSError, SyntaxError, UnicodeDecodeError):
            return None
        module = ModuleSource(name, path.resolve(), tree, is_package)
        _collect_imports(module)
        _collect_top_level(module, tree.body)
        self.modules[name] = module
        _Indexer(self, module).visit(tree)
        self.version += 1
        return module

    def add_function(self, fn: FunctionSource) -> None:
        self.functions.setdefault(fn.key, fn)
        self.function_nodes[id(fn.node)] = fn
        lines = {fn.line}
        if not isinstance(fn.node, ast.Lambda):
            lines |= {d.lineno for d in fn.node.decorator_list}
        for line in lines:
            self.by_location[fn.module.path, line].append(fn)

    def names(self) -> Iterator[str]:
        yield from self.modules
        yield from self.classes
        yield from self.functions


@functools.cache
def source_index(packages: tuple[str, ...]) -> SourceIndex:
    """One parse per set of packages and test session."""
    return SourceIndex(packages)


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


def _underlying_function(obj: object) -> Any:  # noqa: ANN401 (a plain function, of any signature)
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


def _import(name: str) -> ModuleType | None:
    """Only what is already imported: reading the source never imports a library (no side
    effects, no seconds spent loading a broker client the service imports lazily)."""
    return sys.modules.get(name)


def runtime_object(qualified: str) -> object:
    """The object a dotted name denotes in an imported library, or ``MISSING``."""
    parts = qualified.split(".")
    for cut in range(len(parts), 0, -1):
        module = _import(".".join(parts[:cut]))
        if module is None:
            continue
        found: object = module
        for attr in parts[cut:]:
            found = getattr(found, attr, MISSING)
            if found is MISSING:
                return MISSING
        return found
    return MISSING


def classify(obj: object) -> set[Value]:
    if obj is MISSING or obj is None:
        return set()
    if inspect.ismodule(obj):
        return {ModuleRef(obj.__name__)}
    if inspect.isclass(obj):
        return {ClassRef(type_name(obj))}
    qualname = getattr(obj, "__qualname__", None)
    if callable(obj) and isinstance(qualname, str):
        return {External(f"{getattr(obj, '__module__', None) or '?'}.{qualname}")}
    return {Instance(type_name(type(obj)))}


def _runtime_return(func: object) -> set[Value]:
    """A library callable's return type; a decorated one returning ``AsyncIterator[T]``
    (``@asynccontextmanager``) gives ``T``."""
    try:
        annotation = inspect.signature(func).return_annotation  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return set()
    if isinstance(annotation, str):
        namespace = dict(getattr(inspect.unwrap(func), "__globals__", {}))  # type: ignore[arg-type]
        try:
            annotation = eval(annotation, namespace)  # noqa: S307 (the library's own annotation, in its module)
        except (NameError, AttributeError, SyntaxError, TypeError):
            return set()  # an unresolvable annotation leaves the type unknown
    if hasattr(func, "__wrapped__") and typing.get_origin(annotation) in ITERATOR_ORIGINS:
        annotation = typing.get_args(annotation)[0]
    return _instances_of(annotation)


def _instances_of(annotation: object) -> set[Value]:
    if inspect.isclass(annotation):
        return {Instance(type_name(annotation))}
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return {v for arg in typing.get_args(annotation) for v in _instances_of(arg)}
    return set()


class CallGraph:
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

    def _value_callees(self, value: Value) -> list[Callee]:  # noqa: PLR0911 (one answer per kind of value)
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

    # -- hierarchy -----------------------------------------------------------------------------

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

    # -- environment ---------------------------------------------------------------------------

    def scope_of(self, fn: FunctionSource) -> Scope:
        owner: FunctionSource | None = fn
        while owner is not None and owner.owner is None:
            owner = owner.parent
        return Scope(fn.module, fn, owner.owner if owner is not None else None)

    def lookup(self, name: str, scope: Scope) -> set[Value]:
        fn = scope.function
        while fn is not None:
            env = self._env(fn)
            if name in env:
                return env[name]
            fn = fn.parent
        return self._global(scope.module, name)

    def _global(self, module: ModuleSource, name: str) -> set[Value]:
        key = (module.name, name)
        if key in self._globals:
            return self._globals[key]
        self._globals[key] = set()
        values = self._global_uncached(module, name)
        self._globals[key] = values
        return values

    def _global_uncached(self, module: ModuleSource, name: str) -> set[Value]:
        if name in module.defs:
            key = module.defs[name]
            return {ClassRef(key)} if key in self.index.classes else {FunctionRef(key)}
        if name in module.imports:
            return self.resolve(module.imports[name])
        if name in module.assigns:
            scope = Scope(module)
            return {v for value in module.assigns[name] for v in self.infer(value, scope)}
        if hasattr(builtins, name):
            return classify(getattr(builtins, name))
        return set()

    def resolve(self, qualified: str) -> set[Value]:
        """What a dotted name denotes: scanned source first, then the installed libraries."""
        if qualified in self._resolved:
            return self._resolved[qualified]
        self._resolved[qualified] = set()
        values = self._resolve_uncached(qualified)
        self._resolved[qualified] = values
        return values

    def _resolve_uncached(self, qualified: str) -> set[Value]:
        if qualified in self.index.modules:
            return {ModuleRef(qualified)}
        parts = qualified.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            module = self.index.modules.get(".".join(parts[:cut]))
            if module is not None:
                values = self._global(module, parts[cut])
                for attr in parts[cut + 1 :]:
                    values = {v for value in values for v in self.attribute(value, attr)}
                return values
        return classify(runtime_object(qualified)) or {External(qualified)}

    def exists(self, name: str) -> bool:
        """True when ``name`` is a module, class or function of the index, or importable."""
        prefix = f"{name}."
        if any(known == name or known.startswith(prefix) for known in self.index.names()):
            return True
        return runtime_object(name) is not MISSING

    def _env(self, fn: FunctionSource) -> dict[str, set[Value]]:
        env = self._envs.get(fn.key)
        if env is not None:
            return env
        env = {}
        self._envs[fn.key] = env  # visible while it is built: recursion sees a partial scope
        scope = self.scope_of(fn)
        self._bind_parameters(fn, env, scope)
        for node in own_nodes(fn.node):
            self._bind(node, env, scope)
        return env

    def _bind_parameters(self, fn: FunctionSource, env: dict[str, set[Value]], scope: Scope) -> None:
        args = fn.node.args
        params = [*args.posonlyargs, *args.args, *args.kwonlyargs]
        bound = fn.owner is not None and "staticmethod" not in fn.decorators
        for position, arg in enumerate(params):
            if position == 0 and bound and fn.owner is not None:
                first = ClassRef(fn.owner.key) if "classmethod" in fn.decorators else Instance(fn.owner.key)
                env[arg.arg] = {first}
            else:
                env[arg.arg] = self.annotation(arg.annotation, scope)
        for extra in (args.vararg, args.kwarg):
            if extra is not None:
                env[extra.arg] = set()

    def _bind(self, node: ast.AST, env: dict[str, set[Value]], scope: Scope) -> None:
        if isinstance(node, ast.Assign):
            values = self.infer(node.value, scope)
            for target in node.targets:
                _bind_target(target, values, env)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            values = self.annotation(node.annotation, scope)
            values |= self.infer(node.value, scope) if node.value else set()
            env.setdefault(node.target.id, set()).update(values)
        elif isinstance(node, ast.NamedExpr):
            _bind_target(node.target, self.infer(node.value, scope), env)
        elif isinstance(node, ast.With | ast.AsyncWith):
            for item in node.items:
                if item.optional_vars is not None:
                    entered = self._entered(
                        item.context_expr, scope, is_async=isinstance(node, ast.AsyncWith)
                    )
                    _bind_target(item.optional_vars, entered, env)
        elif isinstance(node, ast.For | ast.AsyncFor):
            _bind_target(node.target, set(), env)
        else:
            self._bind_definition(node, env)

    def _bind_definition(self, node: ast.AST, env: dict[str, set[Value]]) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            env[node.name] = {FunctionRef(self.index.function_nodes[id(node)].key)}
        elif isinstance(node, ast.ClassDef):
            env[node.name] = {ClassRef(self.index.class_nodes[id(node)].key)}

    def _entered(self, expr: ast.expr, scope: Scope, *, is_async: bool) -> set[Value]:
        """What ``with expr as x`` binds: ``__(a)enter__``'s return type, else the object."""
        entered: set[Value] = set()
        for value in self.infer(expr, scope):
            method = None
            if isinstance(value, Instance) and value.type in self.index.classes:
                method = self.find_method(value.type, "__aenter__" if is_async else "__enter__")
            returned = self.returns(method) if method is not None else set()
            entered |= returned or {value}
        return entered

    # -- inference -----------------------------------------------------------------------------

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

    def _call_result(self, callee: Value, call: ast.Call, scope: Scope) -> set[Value]:  # noqa: PLR0911 (one answer per kind of callee)
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
