"""What the call graph reads: the scanned packages' source (modules, classes, functions), the
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
import functools
import importlib.util
import inspect
import sys
import types
import typing
from collections import abc, defaultdict
from collections.abc import Iterable, Iterator
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
