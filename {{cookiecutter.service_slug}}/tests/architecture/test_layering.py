"""Layering: the import-linter contracts of ``pyproject.toml``, and bounded contexts that never
import each other.

The contexts are discovered the way the container discovers them (every sub-package with a
``module.py``, minus the framework, the entrypoints and the published contracts), so a context
you add is covered without editing this file. Indirect imports count: a context that reaches
another through any chain of modules is reported with the chain.
"""

from __future__ import annotations

import importlib.util
import itertools
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import grimp
import pytest

from {{ cookiecutter.package_name }}.building_blocks import (
    module as context_contract,
)

pytestmark = pytest.mark.architecture

PACKAGE = context_contract.__name__.partition(".")[0]
PROJECT_ROOT = Path(__file__).resolve().parents[2]
SHARED = context_contract.NOT_CONTEXTS | {"contracts"}


def lint_imports_command() -> list[str]:
    beside = Path(sys.executable).with_name("lint-imports")
    found = str(beside) if beside.exists() else shutil.which("lint-imports")
    if found is None:
        pytest.fail("lint-imports (import-linter) is not installed: run `make install`")
    return [found, "--no-cache", "--no-logo"]  # run in the project root: reads its pyproject.toml


def test_import_linter_contracts_are_kept() -> None:
    result = subprocess.run(
        lint_imports_command(), cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    output = f"{result.stdout}\n{result.stderr}"

    assert result.returncode == 0, output
    kept = re.search(r"Contracts: (\d+) kept, 0 broken", output)
    assert kept is not None, output
    assert int(kept.group(1)) >= 3, output


def bounded_contexts(package: str) -> list[str]:
    """Sub-packages with a ``module.py``, except the framework, entrypoints and contracts."""
    spec = importlib.util.find_spec(package)
    assert spec is not None
    assert spec.submodule_search_locations
    roots = [Path(location) for location in spec.submodule_search_locations]
    return sorted(
        path.parent.name
        for root in roots
        for path in root.glob("*/module.py")
        if path.parent.name not in SHARED
    )


def cross_context_imports(package: str) -> list[str]:
    """Every shortest import chain from one bounded context to another (direct or not)."""
    graph = grimp.build_graph(package, cache_dir=None)
    found: list[str] = []
    for importer, imported in itertools.permutations(bounded_contexts(package), 2):
        chains = graph.find_shortest_chains(
            importer=f"{package}.{importer}", imported=f"{package}.{imported}", as_packages=True
        )
        found += [f"{importer} -> {imported}: {' -> '.join(chain)}" for chain in sorted(chains)]
    return found


def test_bounded_contexts_do_not_import_each_other() -> None:
    violations = cross_context_imports(PACKAGE)

    assert violations == [], (
        "Bounded contexts must not import each other; share integration events through "
        f"{PACKAGE}.contracts and react to them in a consumer instead:\n" + "\n".join(violations)
    )


def test_a_context_importing_another_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check is not vacuous, and covers contexts it has never heard of."""
    package = f"layering_probe_{uuid.uuid4().hex[:8]}"
    files = {
        "__init__.py": "",
        "building_blocks/__init__.py": "",
        "building_blocks/module.py": "",
        "contracts/__init__.py": "",
        "contracts/module.py": "",
        "billing/__init__.py": "",
        "billing/module.py": "",
        "billing/application.py": f"from {package}.shipping.domain import Parcel\n",
        "shipping/__init__.py": "",
        "shipping/module.py": f"from {package}.contracts import module\n",
        "shipping/domain.py": "class Parcel: ...\n",
    }
    for name, text in files.items():
        path = tmp_path / package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))

    assert bounded_contexts(package) == ["billing", "shipping"]
    assert cross_context_imports(package) == [
        f"billing -> shipping: {package}.billing.application -> {package}.shipping.domain"
    ]
