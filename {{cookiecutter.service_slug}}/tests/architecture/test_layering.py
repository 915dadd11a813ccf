"""Layering: the import-linter contracts of ``pyproject.toml`` (and proof that each one can
break), no import cycle anywhere in the service or the kit, bounded contexts that never import
each other and use the kit only through its public surface, a kit that imports no context, and
a domain that imports only what it is allowed to (an allowlist, not a denylist).

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

import {{ cookiecutter.package_name }} as service

from .import_contracts import (
    KIT,
    bounded_contexts,
    cross_context_imports,
    kit_imports_of_contexts,
    private_kit_imports,
)

pytestmark = pytest.mark.architecture

PACKAGE = service.__name__
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


def package_graph(package: str, kit: str = KIT) -> grimp.ImportGraph:
    """The import graph of the service's package and the kit's, together."""
    return grimp.build_graph(package, kit, cache_dir=None)


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
    write_probe(tmp_path, package, files)
    monkeypatch.syspath_prepend(str(tmp_path))

    graph = package_graph(package, f"{package}_kit")
    assert bounded_contexts(graph, package) == ["billing", "shipping"]
    assert cross_context_imports(graph, package) == [
        (
            f"contexts.billing -> contexts.shipping: {package}.contexts.billing.application -> "
            f"{package}.contexts.shipping.domain"
        )
    ]


def test_the_kit_imports_no_bounded_context() -> None:
    violations = kit_imports_of_contexts(package_graph(PACKAGE), PACKAGE)

    assert violations == [], (
        "The kit is shared by every context and must not import one; move the code into the "
        "context, or make the kit take it as a parameter:\n" + "\n".join(violations)
    )


def domain_root(package: str, module: str, kit: str = KIT) -> str | None:
    """``<kit>.domain`` or ``<package>.contexts.<name>.domain`` (None when the module is no domain
    module)."""
    parts = module.split(".")
    if parts[:2] == [kit, "domain"]:
        return ".".join(parts[:2])
    if len(parts) >= 4 and parts[:2] == [package, "contexts"] and parts[3] == "domain":
        return ".".join(parts[:4])
    return None


def domain_imports_outside_the_allowlist(package: str, kit: str = KIT) -> list[str]:
    """Imports of domain modules (``<context>.domain``, the kit's ``domain``) that are not the
    standard library, the kit's domain or the context's own domain."""
    graph = grimp.build_graph(package, kit, include_external_packages=True, cache_dir=None)
    allowed_shared = f"{kit}.domain"
    violations: list[str] = []
    for module in sorted(m for m in graph.modules if domain_root(package, m, kit) is not None):
        own = str(domain_root(package, module, kit))
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            top = imported.partition(".")[0]
            if top in sys.stdlib_module_names or top == "__future__":
                continue
            if any(imported == root or imported.startswith(f"{root}.") for root in (allowed_shared, own)):
                continue
            for detail in graph.get_import_details(importer=module, imported=imported) or [{}]:
                violations.append(f"{module}:{detail.get('line_number', '?')} imports {imported}")
    return violations


def test_the_domain_imports_only_the_standard_library_and_the_kits_domain() -> None:
    violations = domain_imports_outside_the_allowlist(PACKAGE)

    assert violations == [], (
        f"A domain module may import the standard library, {KIT}.domain and its own "
        "context's domain only (no framework, no persistence, no other context):\n" + "\n".join(violations)
    )


# The kit's concrete adapters: the in-process bus, the subscriber wrapper and one layer per broker.
KIT_ADAPTERS = ("transports.in_process", "consume.subscribers", "transports.base", "transports.rabbit")
KIT_ADAPTERS += ("transports.kafka", "transports.nats", "transports.redis")


def is_adapter(package: str, module: str, kit: str = KIT) -> bool:
    """A concrete adapter: a context's ``infrastructure``, the kit's buses and broker layers."""
    parts = module.removeprefix(f"{package}.").split(".")
    if parts[0] == "contexts" and len(parts) >= 3 and parts[2] == "infrastructure":
        return True
    return module.removeprefix(f"{kit}.") in KIT_ADAPTERS


def may_import_adapters(package: str, module: str, kit: str = KIT) -> bool:
    """The composition: the service's container and the kit's, ``__main__``, a context's
    ``module.py`` (its adapters map), the adapters themselves, and the kit's test tooling."""
    parts = module.removeprefix(f"{package}.").split(".")
    # The kit's test tooling (outbox_kit.testing) reaches brokers and adapters on purpose.
    composition = (
        module == f"{kit}.runtime.container"
        or module.startswith(f"{kit}.testing.")
        or (
            module.startswith(f"{package}.")
            and (parts[0] in {"container", "__main__"} or (parts[0] == "contexts" and parts[-1] == "module"))
        )
    )
    return composition or is_adapter(package, module, kit)


def adapter_imports_outside_the_composition(package: str, kit: str = KIT) -> list[str]:
    """Every direct import of a concrete adapter by a module that is not allowed one (an
    allowlist: a context module with a name no contract lists is covered too)."""
    graph = package_graph(package, kit)
    found: list[str] = []
    for module in sorted(graph.modules):
        if may_import_adapters(package, module, kit):
            continue
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            if is_adapter(package, imported, kit):
                lines = graph.get_import_details(importer=module, imported=imported) or [{}]
                found += [f"{module}:{line.get('line_number', '?')} imports {imported}" for line in lines]
    return found


def test_only_the_composition_imports_concrete_adapters() -> None:
    violations = adapter_imports_outside_the_composition(PACKAGE)

    assert violations == [], (
        "Only the containers (the service's and the kit's), __main__ and a context's module.py import "
        "adapters; depend on the port (a Protocol) and let module.py map it:\n" + "\n".join(violations)
    )


def write_probe(root: Path, package: str, files: dict[str, str]) -> None:
    """A probe service package, and beside it its kit (``<package>_kit``): a file named
    ``kit/...`` goes to the kit."""
    (root / f"{package}_kit").mkdir(parents=True, exist_ok=True)
    (root / f"{package}_kit" / "__init__.py").touch()
    for name, text in files.items():
        folder, _, rest = name.partition("/")
        path = root / f"{package}_kit" / rest if folder == "kit" else root / package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_the_kit_importing_a_context_and_a_leaky_domain_are_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = f"layering_probe_{uuid.uuid4().hex[:8]}"
    kit = f"{package}_kit"
    write_probe(
        tmp_path,
        package,
        {
            "__init__.py": "",
            "kit/domain/__init__.py": "import dataclasses\n",
            "kit/persistence.py": "",
            "kit/registry.py": f"from {package}.contexts.billing import module\n",
            "contexts/__init__.py": "",
            "contexts/billing/__init__.py": "",
            "contexts/billing/module.py": "",
            "contexts/billing/domain.py": (
                "from __future__ import annotations\n"
                "import decimal\n"
                f"from {kit}.domain import dataclasses\n"
                f"from {kit} import persistence\n"
                "import pytest\n"
            ),
        },
    )
    monkeypatch.syspath_prepend(str(tmp_path))

    assert kit_imports_of_contexts(package_graph(package, kit), package, kit) == [
        f"{kit} -> contexts.billing: {kit}.registry -> {package}.contexts.billing.module"
    ]
    assert domain_imports_outside_the_allowlist(package, kit) == [
        f"{package}.contexts.billing.domain:4 imports {kit}.persistence",
        f"{package}.contexts.billing.domain:5 imports pytest",
    ]


def test_contexts_use_only_the_public_surface_of_the_kit() -> None:
    violations = private_kit_imports(package_graph(PACKAGE), PACKAGE)

    assert violations == [], (
        f"A context imports from the kit only {KIT}.public (and {KIT}.domain in its domain "
        "layer):\n" + "\n".join(violations)
    )


def test_a_context_reaching_past_the_public_surface_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = f"surface_probe_{uuid.uuid4().hex[:8]}"
    kit = f"{package}_kit"
    write_probe(
        tmp_path,
        package,
        {
            "__init__.py": "",
            "kit/public.py": f"from {kit}.polling import leases\n",
            "kit/domain/__init__.py": "",
            "kit/polling/__init__.py": "",
            "kit/polling/leases.py": "",
            "contexts/__init__.py": "",
            "contexts/billing/__init__.py": "",
            "contexts/billing/module.py": f"from {kit} import public\n",
            "contexts/billing/domain.py": f"from {kit} import domain\n",
            "contexts/billing/application.py": f"\nfrom {kit}.polling import leases\n",
        },
    )
    monkeypatch.syspath_prepend(str(tmp_path))

    assert private_kit_imports(package_graph(package, kit), package, kit) == [
        f"{package}.contexts.billing.application:2 imports {kit}.polling.leases"
    ]


def import_cycles(package: str, kit: str = KIT) -> list[list[str]]:
    """Every group of modules that import each other, directly or in a ring (type-only imports
    included), as sorted module lists."""
    graph = package_graph(package, kit)
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

    assert import_cycles(package, f"{package}_kit") == [[f"{package}.factory", f"{package}.unit"]]


def test_an_adapter_imported_outside_the_composition_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = f"adapter_probe_{uuid.uuid4().hex[:8]}"
    kit = f"{package}_kit"
    write_probe(
        tmp_path,
        package,
        {
            "__init__.py": "",
            "container.py": f"from {kit}.transports import rabbit\n",
            "kit/runtime/__init__.py": "",
            "kit/runtime/container.py": f"from {kit}.transports import in_process\n",
            "kit/runtime/worker.py": f"from {kit}.transports import in_process\n",
            "kit/transports/__init__.py": "",
            "kit/transports/in_process.py": f"from {kit}.transports import rabbit\n",
            "kit/transports/rabbit.py": "",
            "contexts/__init__.py": "",
            "contexts/billing/__init__.py": "",
            "contexts/billing/module.py": f"from {package}.contexts.billing import infrastructure\n",
            "contexts/billing/infrastructure.py": "",
            "contexts/billing/services.py": f"from {package}.contexts.billing.infrastructure import *\n",
        },
    )
    monkeypatch.syspath_prepend(str(tmp_path))

    assert adapter_imports_outside_the_composition(package, kit) == [
        f"{package}.contexts.billing.services:1 imports {package}.contexts.billing.infrastructure",
        f"{kit}.runtime.worker:1 imports {kit}.transports.in_process",
    ]


def renamed(text: str, package: str, kit: str) -> str:
    """``text`` with the service's package and the kit's renamed (whole names only: a service
    called ``outbox`` must not rename ``outbox_kit``)."""
    for old, new in ((PACKAGE, package), (KIT, kit)):
        text = re.sub(rf"(?<![\w.]){re.escape(old)}(?!\w)", new, text)
    return text


def importlinter_ini(package: str, kit: str) -> str:
    """The project's import-linter contracts, for other root packages, as an ``.ini`` file."""
    config = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    linter = config["tool"]["importlinter"]
    lines = [
        "[importlinter]",
        "root_packages ="
        + "".join(f"\n    {renamed(root, package, kit)}" for root in linter["root_packages"]),
        f"include_external_packages = {linter.get('include_external_packages', False)}",
        "contract_types =" + "".join(f"\n    {entry}" for entry in linter.get("contract_types", [])),
    ]
    for number, contract in enumerate(linter["contracts"]):
        lines.append(f"[importlinter:contract:{number}]")
        for key, value in contract.items():
            if isinstance(value, list):
                items = "".join(f"\n    {renamed(item, package, kit)}" for item in value)
                lines.append(f"{key} ={items}")
            elif key == "name":  # as written: the report names the contract
                lines.append(f"{key} = {value}")
            else:
                lines.append(f"{key} = {renamed(str(value), package, kit)}")
    return "\n".join(lines) + "\n"


LAYERS = ("public", "testing", "runtime", "operations", "consume", "processor", "persistence", "transports")
LAYERS += ("application", "domain")


def test_every_import_linter_contract_can_break(tmp_path: Path) -> None:
    """A probe package breaks each contract once: each is reported broken, so none is vacuous
    (a pattern that matches no module, a misspelt package)."""
    package = f"contract_probe_{uuid.uuid4().hex[:8]}"
    kit = f"{package}_kit"
    write_probe(
        tmp_path,
        package,
        {
            "__init__.py": "",
            "container.py": "",
            "__main__.py": "",
            "contracts/__init__.py": "",
            "settings.py": "",
            "about.py": "",
            **{f"kit/{layer}/__init__.py": "" for layer in LAYERS},
            "kit/application/clock.py": f"import {kit}.transports\n",  # a floor imports upwards
            "kit/application/messages.py": f"import {package}.container\n",
            "kit/persistence/tables.py": f"import {package}.contexts.shipping.module\n",
            "contexts/__init__.py": "",
            "contexts/billing/__init__.py": "",
            "contexts/billing/module.py": f"import {package}.contexts.shipping.module\n",
            "contexts/billing/domain.py": f"import {kit}.persistence\n",
            "contexts/billing/infrastructure.py": "",
            "contexts/billing/application.py": f"import {package}.contexts.billing.infrastructure\n",
            "contexts/billing/api.py": f"import {kit}.runtime\n",  # past the public surface
            "contexts/shipping/__init__.py": "",
            "contexts/shipping/module.py": "",
        },
    )
    config = tmp_path / ".importlinter"
    config.write_text(importlinter_ini(package, kit), encoding="utf-8")
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
    assert f"{kit} -> contexts.shipping" in output
    assert f"{package}.contexts.billing.api:1 imports" in output  # the public surface, with the line
