"""Every name the docs cite exists: the docs are part of the product and must stay true to it.

Each span in backticks (outside code blocks) of the docs that describe the present is checked by
its shape:

* a dotted name under ``outbox_kit`` or the service's package names a module, or a name defined
  at the top of one (and, one level further, in a class of it). Read from the sources (``ast``),
  so nothing is imported;
* a path (``runtime/heap.py``, ``contexts/orders/``) exists in the default bake (from its root,
  ``kit/``, ``kit/src/``, the kit's package or the service's package) or in this repository;
  a bare file name exists somewhere in either;
* a setting (``OUTBOX__BATCH_SIZE``; a context's ``SOURCES__NOTIFICATIONS__SCHEMA``) is one the
  generated ``.env.example`` lists (a test of the service checks it lists every setting).

And every name ``outbox_kit.public`` exports is cited in backticks by one of those docs, and
architecture.md's table of the kit's packages lists each package's modules, no more and no fewer
(the names outside parentheses in its second column).

The histories are not read: the changelogs, upgrading.md (what each kit version renamed) and
performance.md (what each round measured) name what existed then. Spans with a placeholder
(``<name>``, ``*``, ``{...}``) or a space are prose, not names.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

from .support import TEMPLATE

pytestmark = pytest.mark.render

HISTORY = {"CHANGELOG.md", "upgrading.md", "performance.md"}
# What a command creates and the docs point at: a virtual environment, bakes, cruft's record of
# the answers, the reliability tier's reports.
CREATED = {".venv/", "build/", "build/demo/", ".cruft.json", "reliability-report.md"}
CREATED |= {"reliability-mutations.md"}
# extending.md's walk-through creates this context: its files do not exist before the reader
# writes them.
WALK_THROUGH = "contexts/invoices/"
FENCE = re.compile(r"```.*?```", re.DOTALL)
SPAN = re.compile(r"`([^`\n]+)`")
PROSE = re.compile(r"[<>*{}\s…|]")
FILE = r"\.(?:py|md|toml|ini|cfg|lock|ya?ml|json|txt|sh)"
PATH = re.compile(rf"\.?[\w-]+(?:\.[\w-]+)*(?:/\.?[\w.-]+)*(?:{FILE}|/)")
SETTING = re.compile(r"[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)*__[A-Z0-9_]+")
CONTEXT_SETTING = re.compile(r"SOURCES__[A-Z0-9_]+?__([A-Z0-9_]+)")


def pages(project: Path) -> list[Path]:
    found = [
        project / "README.md",
        project / "kit" / "README.md",
        *sorted((project / "docs").glob("*.md")),
        TEMPLATE / "README.md",
        *sorted((TEMPLATE / "docs").glob("*.md")),
    ]
    return [page for page in found if page.name not in HISTORY]


def spans(page: Path) -> list[str]:
    return [span.strip().removesuffix("()") for span in SPAN.findall(FENCE.sub("", page.read_text()))]


@cache
def tree_of(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def names_of(body: list[ast.stmt]) -> set[str]:
    """The names a module (or class) body defines, imports included (a re-export is a name)."""
    names: set[str] = set()
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, ast.If | ast.Try):
            names |= names_of([*node.body, *node.orelse])
    return names


def defines(module: Path, attributes: list[str]) -> bool:
    """Whether ``module`` defines ``attributes[0]`` (and its class ``attributes[1]``)."""
    body = tree_of(module).body
    if attributes[0] not in names_of(body):
        return False
    if len(attributes) == 1:
        return True
    classes = [node for node in body if isinstance(node, ast.ClassDef) and node.name == attributes[0]]
    return not classes or attributes[1] in names_of(classes[0].body)


def resolves(dotted: str, sources: dict[str, Path]) -> bool:
    """A module of the package, or a name one defines (the longest module prefix first)."""
    root, *parts = dotted.split(".")
    for cut in range(len(parts), -1, -1):
        folder = sources[root].joinpath(*parts[:cut])
        if cut and folder.with_suffix(".py").is_file():
            module = folder.with_suffix(".py")
        elif folder.is_dir():
            module = folder / "__init__.py"
        else:
            continue
        rest = parts[cut:]
        return not rest or (module.is_file() and defines(module, rest))
    return False


def wrong_names(project: Path) -> list[str]:
    package = next(path.name for path in (project / "src").iterdir() if (path / "__init__.py").is_file())
    sources = {"outbox_kit": project / "kit" / "src" / "outbox_kit", package: project / "src" / package}
    dotted = re.compile(rf"(?:outbox_kit|{package})(?:\.\w+)+")
    roots = [project, project / "kit", project / "kit" / "src", *sources.values(), TEMPLATE]
    files = {path.name for path in project.rglob("*")} | {path.name for path in TEMPLATE.iterdir()}
    for folder in (TEMPLATE / "tests", TEMPLATE / "tools", TEMPLATE / ".ci"):
        files |= {path.name for path in folder.rglob("*")}
    env_example = (project / ".env.example").read_text()
    wrong = []
    for page in pages(project):
        for span in spans(page):
            name = span.split("=")[0]
            if PROSE.search(span) or span in CREATED or span.startswith(WALK_THROUGH):
                continue
            if dotted.fullmatch(span):
                found = resolves(span, sources)
            elif SETTING.fullmatch(name):
                found = CONTEXT_SETTING.sub(r"SOURCES__<CONTEXT>__\1", name) in env_example
            elif PATH.fullmatch(span) and not span.startswith(("http", "/")):
                bare = "/" not in span.rstrip("/")
                found = span.rstrip("/") in files if bare else any((root / span).exists() for root in roots)
            else:
                continue
            if not found:
                wrong.append(f"{page.name}: `{span}`")
    return wrong


def test_every_module_path_and_setting_the_docs_name_exists(bakes: dict[str, Path]) -> None:
    assert wrong_names(bakes["default"]) == []


def test_every_public_name_of_the_kit_is_documented(bakes: dict[str, Path]) -> None:
    project = bakes["default"]
    public = tree_of(project / "kit" / "src" / "outbox_kit" / "public.py")
    exported = next(
        ast.literal_eval(node.value)
        for node in public.body
        if isinstance(node, ast.Assign) and [getattr(name, "id", "") for name in node.targets] == ["__all__"]
    )
    cited = {span.rpartition(".")[2] for page in pages(project) for span in spans(page)}
    assert [name for name in exported if name not in cited] == []


PACKAGE_ROW = re.compile(r"^\| `(\w+)` \| (.*?) \| .*\|$", re.MULTILINE)
ASIDE = re.compile(r"\([^()]*\)")


def test_the_architecture_lists_each_kit_package_with_its_modules(bakes: dict[str, Path]) -> None:
    project = bakes["default"]
    kit = project / "kit" / "src" / "outbox_kit"
    table = {}
    for package, cell in PACKAGE_ROW.findall((project / "docs" / "architecture.md").read_text()):
        if (kit / package).is_dir():
            listed = cell
            while ASIDE.search(listed):
                listed = ASIDE.sub("", listed)
            table[package] = sorted(set(re.findall(r"`(\w+)`", listed)))
    on_disk = {
        package.name: sorted(module.stem for module in package.glob("*.py") if module.stem != "__init__")
        for package in kit.iterdir()
        if (package / "__init__.py").is_file()
    }
    assert table == on_disk
