"""The scanned packages, parsed with ``ast``: modules, classes and functions (lambdas and nested
functions included) with their imports and top-level names. Nothing here runs the code it reads."""

from __future__ import annotations

import ast
import functools
import importlib.util
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .values import FunctionNode


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
