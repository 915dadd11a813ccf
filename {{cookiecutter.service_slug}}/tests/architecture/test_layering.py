"""Layering: the import-linter contracts of ``pyproject.toml`` (and proof that each one can
break), no import cycle anywhere in the package, bounded contexts that never import each other
and use the building blocks only through their public surface, building blocks that import no
context, and a domain that imports only what it is allowed to (an allowlist, not a denylist).

The contexts are discovered the way the container discovers them (every folder of ``contexts/``
with a ``module.py``), so a context you add is covered without editing this file. Indirect
imports count: a context that reaches another through any chain of modules is reported with the
chain. Type-only imports (under ``TYPE_CHECKING``) count too: a cycle is broken with a Protocol.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
import uuid
from pathlib import Path

import grimp
import pytest

from {{ cookiecutter.package_name }}.building_blocks.application import (
    module as context_contract,
)

from .import_contracts import (
    bounded_contexts,
    building_block_imports_of_contexts,
    cross_context_imports,
    private_building_block_imports,
)

pytestmark = pytest.mark.architecture

PACKAGE = context_contract.__name__.partition(".")[0]
PROJECT_ROOT = Path(__file__).resolve().parents[2]


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
    assert int(kept.group(1)) >= 6, output


def package_graph(package: str) -> grimp.ImportGraph:
    return grimp.build_graph(package, cache_dir=None)


def test_bounded_contexts_do_not_import_each_other() -> None:
    violations = cross_context_imports(package_graph(PACKAGE), PACKAGE)

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
        "contracts/__init__.py": "",
        "contracts/module.py": "",
        "contexts/__init__.py": "",
        "contexts/billing/__init__.py": "",
        "contexts/billing/module.py": "",
        "contexts/billing/application.py": f"from {package}.contexts.shipping.domain import Parcel\n",
        "contexts/shipping/__init__.py": "",
        "contexts/shipping/module.py": f"from {package}.contracts import module\n",
        "contexts/shipping/domain.py": "class Parcel: ...\n",
        "contexts/notes/__init__.py": "",  # no module.py: not a context
    }
    for name, text in files.items():
        path = tmp_path / package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))

    graph = package_graph(package)
    assert bounded_contexts(graph, package) == ["billing", "shipping"]
    assert cross_context_imports(graph, package) == [
        (
            f"contexts.billing -> contexts.shipping: {package}.contexts.billing.application -> "
            f"{package}.contexts.shipping.domain"
        )
    ]


def test_building_blocks_import_no_bounded_context() -> None:
    violations = building_block_imports_of_contexts(package_graph(PACKAGE), PACKAGE)

    assert violations == [], (
        "building_blocks is shared by every context and must not import one; move the code into "
        "the context, or make the building block take it as a parameter:\n" + "\n".join(violations)
    )


def domain_root(package: str, module: str) -> str | None:
    """``<package>.building_blocks.domain`` or ``<package>.contexts.<name>.domain`` (None when the
    module is no domain module)."""
    parts = module.split(".")
    if parts[:3] == [package, "building_blocks", "domain"]:
        return ".".join(parts[:3])
    if len(parts) >= 4 and parts[:2] == [package, "contexts"] and parts[3] == "domain":
        return ".".join(parts[:4])
    return None


def domain_imports_outside_the_allowlist(package: str) -> list[str]:
    """Imports of domain modules (``<context>.domain``, ``building_blocks.domain``) that are not
    the standard library, the domain building blocks or the context's own domain."""
    graph = grimp.build_graph(package, include_external_packages=True, cache_dir=None)
    allowed_shared = f"{package}.building_blocks.domain"
    violations: list[str] = []
    for module in sorted(m for m in graph.modules if domain_root(package, m) is not None):
        own = str(domain_root(package, module))
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            top = imported.partition(".")[0]
            if top in sys.stdlib_module_names or top == "__future__":
                continue
            if any(imported == root or imported.startswith(f"{root}.") for root in (allowed_shared, own)):
                continue
            for detail in graph.get_import_details(importer=module, imported=imported) or [{}]:
                violations.append(f"{module}:{detail.get('line_number', '?')} imports {imported}")
    return violations


def test_the_domain_imports_only_the_standard_library_and_domain_building_blocks() -> None:
    violations = domain_imports_outside_the_allowlist(PACKAGE)

    assert violations == [], (
        "A domain module may import the standard library, building_blocks.domain and its own "
        "context's domain only (no framework, no persistence, no other context):\n" + "\n".join(violations)
    )


def is_adapter(package: str, module: str) -> bool:
    """A concrete adapter: a context's ``infrastructure``, the brokers (buses and transports)."""
    parts = module.removeprefix(f"{package}.").split(".")
    if parts[0] == "contexts" and len(parts) >= 3 and parts[2] == "infrastructure":
        return True
    return parts[:2] == ["building_blocks", "brokers"]


def may_import_adapters(package: str, module: str) -> bool:
    """The composition: the container and its builders, the entrypoints, a context's
    ``module.py`` (its adapters map), and the adapters themselves."""
    parts = module.removeprefix(f"{package}.").split(".")
    composition = parts[0] in {"container", "composition", "entrypoints"} or (
        parts[0] == "contexts" and parts[-1] == "module"
    )
    return composition or is_adapter(package, module)


def adapter_imports_outside_the_composition(package: str) -> list[str]:
    """Every direct import of a concrete adapter by a module that is not allowed one (an
    allowlist: a context module with a name no contract lists is covered too)."""
    graph = package_graph(package)
    found: list[str] = []
    for module in sorted(graph.modules):
        if may_import_adapters(package, module):
            continue
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            if is_adapter(package, imported):
                lines = graph.get_import_details(importer=module, imported=imported) or [{}]
                found += [f"{module}:{line.get('line_number', '?')} imports {imported}" for line in lines]
    return found


def test_only_the_composition_imports_concrete_adapters() -> None:
    violations = adapter_imports_outside_the_composition(PACKAGE)

    assert violations == [], (
        "Only container.py, composition/, the entrypoints and a context's module.py import "
        "adapters; depend on the port (a Protocol) and let module.py map it:\n" + "\n".join(violations)
    )


def write_probe(root: Path, package: str, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_a_building_block_importing_a_context_and_a_leaky_domain_are_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = f"layering_probe_{uuid.uuid4().hex[:8]}"
    write_probe(
        tmp_path,
        package,
        {
            "__init__.py": "",
            "building_blocks/__init__.py": "",
            "building_blocks/domain/__init__.py": "import dataclasses\n",
            "building_blocks/persistence.py": "",
            "building_blocks/registry.py": f"from {package}.contexts.billing import module\n",
            "contexts/__init__.py": "",
            "contexts/billing/__init__.py": "",
            "contexts/billing/module.py": "",
            "contexts/billing/domain.py": (
                "from __future__ import annotations\n"
                "import decimal\n"
                f"from {package}.building_blocks.domain import dataclasses\n"
                f"from {package}.building_blocks import persistence\n"
                "import pytest\n"
            ),
        },
    )
    monkeypatch.syspath_prepend(str(tmp_path))

    assert building_block_imports_of_contexts(package_graph(package), package) == [
        (
            f"building_blocks -> contexts.billing: {package}.building_blocks.registry -> "
            f"{package}.contexts.billing.module"
        )
    ]
    assert domain_imports_outside_the_allowlist(package) == [
        f"{package}.contexts.billing.domain:4 imports {package}.building_blocks.persistence",
        f"{package}.contexts.billing.domain:5 imports pytest",
    ]


def test_contexts_use_only_the_public_surface_of_the_building_blocks() -> None:
    violations = private_building_block_imports(package_graph(PACKAGE), PACKAGE)

    assert violations == [], (
        "A context imports from the building blocks only building_blocks.public (and "
        "building_blocks.domain in its domain layer):\n" + "\n".join(violations)
    )


def test_a_context_reaching_past_the_public_surface_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = f"surface_probe_{uuid.uuid4().hex[:8]}"
    write_probe(
        tmp_path,
        package,
        {
            "__init__.py": "",
            "building_blocks/__init__.py": "",
            "building_blocks/public.py": f"from {package}.building_blocks.polling import leases\n",
            "building_blocks/domain/__init__.py": "",
            "building_blocks/polling/__init__.py": "",
            "building_blocks/polling/leases.py": "",
            "contexts/__init__.py": "",
            "contexts/billing/__init__.py": "",
            "contexts/billing/module.py": f"from {package}.building_blocks import public\n",
            "contexts/billing/domain.py": f"from {package}.building_blocks import domain\n",
            "contexts/billing/application.py": f"\nfrom {package}.building_blocks.polling import leases\n",
        },
    )
    monkeypatch.syspath_prepend(str(tmp_path))

    assert private_building_block_imports(package_graph(package), package) == [
        f"{package}.contexts.billing.application:2 imports {package}.building_blocks.polling.leases"
    ]


def import_cycles(package: str) -> list[list[str]]:
    """Every group of modules that import each other, directly or in a ring (type-only imports
    included), as sorted module lists."""
    graph = package_graph(package)
    cycles = []
    for module in sorted(graph.modules):
        for imported in graph.find_modules_directly_imported_by(module):
            if graph.chain_exists(importer=imported, imported=module):
                ring = {module, imported}
                ring.update(graph.find_shortest_chain(importer=imported, imported=module) or ())
                if sorted(ring) not in cycles:
                    cycles.append(sorted(ring))
    return sorted(cycles)


def test_the_package_has_no_import_cycle() -> None:
    cycles = import_cycles(PACKAGE)

    assert cycles == [], (
        "Modules that import each other, directly or through others (a TYPE_CHECKING import "
        "counts: break the cycle with a Protocol in the lower module):\n"
        + "\n".join(" <-> ".join(ring) for ring in cycles)
    )


def test_a_cycle_through_a_type_only_import_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = f"cycle_probe_{uuid.uuid4().hex[:8]}"
    write_probe(
        tmp_path,
        package,
        {
            "__init__.py": "",
            "factory.py": f"from {package}.unit import Unit\n",
            "unit.py": (
                "from typing import TYPE_CHECKING\n"
                f"if TYPE_CHECKING:\n    from {package}.factory import Factory\n"
                "class Unit: ...\n"
            ),
            "leaf.py": f"from {package} import unit\n",
        },
    )
    monkeypatch.syspath_prepend(str(tmp_path))

    assert import_cycles(package) == [[f"{package}.factory", f"{package}.unit"]]


def test_an_adapter_imported_outside_the_composition_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = f"adapter_probe_{uuid.uuid4().hex[:8]}"
    brokers = f"{package}.building_blocks.brokers"
    write_probe(
        tmp_path,
        package,
        {
            "__init__.py": "",
            "container.py": f"from {brokers} import transports\n",
            "composition/__init__.py": "",
            "composition/edges.py": f"from {brokers} import faststream_bus\n",
            "building_blocks/__init__.py": "",
            "building_blocks/runtime.py": f"from {brokers} import faststream_bus\n",
            "building_blocks/brokers/__init__.py": "",
            "building_blocks/brokers/faststream_bus.py": f"from {brokers} import transports\n",
            "building_blocks/brokers/transports.py": "",
            "contexts/__init__.py": "",
            "contexts/billing/__init__.py": "",
            "contexts/billing/module.py": f"from {package}.contexts.billing import infrastructure\n",
            "contexts/billing/infrastructure.py": "",
            "contexts/billing/services.py": f"from {package}.contexts.billing.infrastructure import *\n",
        },
    )
    monkeypatch.syspath_prepend(str(tmp_path))

    assert adapter_imports_outside_the_composition(package) == [
        f"{package}.building_blocks.runtime:1 imports {package}.building_blocks.brokers.faststream_bus",
        f"{package}.contexts.billing.services:1 imports {package}.contexts.billing.infrastructure",
    ]


def importlinter_ini(package: str) -> str:
    """The project's import-linter contracts, for another root package, as an ``.ini`` file."""
    config = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    linter = config["tool"]["importlinter"]
    lines = [
        "[importlinter]",
        f"root_package = {package}",
        f"include_external_packages = {linter.get('include_external_packages', False)}",
        "contract_types =" + "".join(f"\n    {entry}" for entry in linter.get("contract_types", [])),
    ]
    for number, contract in enumerate(linter["contracts"]):
        lines.append(f"[importlinter:contract:{number}]")
        for key, value in contract.items():
            if isinstance(value, list):
                items = "".join(f"\n    {item.replace(PACKAGE, package, 1)}" for item in value)
                lines.append(f"{key} ={items}")
            else:
                lines.append(f"{key} = {str(value).replace(PACKAGE, package, 1)}")
    return "\n".join(lines) + "\n"


LAYERS = ("public", "runtime", "web", "brokers", "operations", "outbox", "inbox", "commands", "idempotency")
LAYERS += ("unit_of_work", "messaging", "polling", "persistence", "application", "kernel", "domain")


def test_every_import_linter_contract_can_break(tmp_path: Path) -> None:
    """A probe package breaks each contract once: each is reported broken, so none is vacuous
    (a pattern that matches no module, a misspelt package)."""
    package = f"contract_probe_{uuid.uuid4().hex[:8]}"
    bb = f"{package}.building_blocks"
    write_probe(
        tmp_path,
        package,
        {
            "__init__.py": "",
            "container.py": "",
            "composition/__init__.py": "",
            "entrypoints/__init__.py": "",
            "contracts/__init__.py": "",
            "settings.py": "",
            "about.py": "",
            "building_blocks/__init__.py": "",
            **{f"building_blocks/{layer}/__init__.py": "" for layer in LAYERS},
            "building_blocks/kernel/clock.py": f"import {bb}.brokers\n",  # a floor imports upwards
            "building_blocks/application/handlers.py": f"import {package}.container\n",
            "building_blocks/persistence/tables.py": f"import {package}.contexts.shipping.module\n",
            "contexts/__init__.py": "",
            "contexts/billing/__init__.py": "",
            "contexts/billing/module.py": f"import {package}.contexts.shipping.module\n",
            "contexts/billing/domain.py": f"import {bb}.persistence\n",
            "contexts/billing/infrastructure.py": "",
            "contexts/billing/application.py": f"import {package}.contexts.billing.infrastructure\n",
            "contexts/billing/api.py": f"import {bb}.web\n",  # past the public surface
            "contexts/shipping/__init__.py": "",
            "contexts/shipping/module.py": "",
        },
    )
    config = tmp_path / ".importlinter"
    config.write_text(importlinter_ini(package), encoding="utf-8")
    result = subprocess.run(
        [*lint_imports_command(), str(config)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(PROJECT_ROOT)])},
    )
    output = f"{result.stdout}\n{result.stderr}"
    contracts = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"][
        "importlinter"
    ]["contracts"]

    assert result.returncode != 0, output
    assert f"Contracts: 0 kept, {len(contracts)} broken" in output, output
    for contract in contracts:
        assert f"{contract['name']} BROKEN" in output, output
    assert "contexts.billing -> contexts.shipping" in output  # the discovered contexts, with the chain
    assert "building_blocks -> contexts.shipping" in output
    assert f"{package}.contexts.billing.api:1 imports" in output  # the public surface, with the line
