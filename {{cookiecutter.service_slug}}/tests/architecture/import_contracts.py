"""Import-linter contract types for the bounded contexts, found the way the container finds them.

import-linter's built-in contracts name their modules, so a contract listing ``orders`` and
``notifications`` would not cover the context a user adds next. These contract types (registered
in ``pyproject.toml`` under ``contract_types``) discover the contexts from the import graph
instead: every folder of ``contexts/`` with a ``module.py``.

* ``bounded_contexts``: no context imports another one (they talk through integration events),
  and ``building_blocks`` imports no context (the framework knows none of its users); indirect
  imports included, each reported with its chain;
* ``public_surface``: a context (and ``contracts/``) imports from the building blocks only
  ``building_blocks.public`` and ``building_blocks.domain``: everything else is internal and may
  change without breaking a context. Reported with file and line.

``lint-imports`` runs them with the built-in contracts (``make lint``), and the architecture tier
runs ``lint-imports``; the functions below are also what ``test_layering`` calls.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import grimp
from importlinter import Contract, ContractCheck, fields, output

CONTEXTS = "contexts"
PUBLIC = ("building_blocks.public", "building_blocks.domain")


def bounded_contexts(graph: grimp.ImportGraph, package: str) -> list[str]:
    """The folders of ``<package>.contexts`` with a ``module.py``."""
    prefix = f"{package}.{CONTEXTS}."
    return sorted(
        module.removeprefix(prefix).partition(".")[0]
        for module in graph.modules
        if module.startswith(prefix) and module.count(".") == 3 and module.endswith(".module")
    )


def import_chains(graph: grimp.ImportGraph, package: str, pairs: Iterable[tuple[str, str]]) -> list[str]:
    """The shortest import chains (direct or not) between sub-packages, one line per chain."""
    found: list[str] = []
    for importer, imported in pairs:
        chains = graph.find_shortest_chains(
            importer=f"{package}.{importer}", imported=f"{package}.{imported}", as_packages=True
        )
        found += [f"{importer} -> {imported}: {' -> '.join(chain)}" for chain in sorted(chains)]
    return found


def cross_context_imports(graph: grimp.ImportGraph, package: str) -> list[str]:
    contexts = [f"{CONTEXTS}.{name}" for name in bounded_contexts(graph, package)]
    return import_chains(graph, package, itertools.permutations(contexts, 2))


def building_block_imports_of_contexts(graph: grimp.ImportGraph, package: str) -> list[str]:
    contexts = [f"{CONTEXTS}.{name}" for name in bounded_contexts(graph, package)]
    return import_chains(graph, package, [("building_blocks", context) for context in contexts])


def is_public(package: str, module: str) -> bool:
    return any(module == f"{package}.{p}" or module.startswith(f"{package}.{p}.") for p in PUBLIC)


def private_building_block_imports(graph: grimp.ImportGraph, package: str) -> list[str]:
    """Direct imports of an internal building-block module by a context or the contracts."""
    users = (f"{package}.{CONTEXTS}.", f"{package}.contracts")
    found: list[str] = []
    for module in sorted(m for m in graph.modules if m.startswith(users)):
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            if imported.startswith(f"{package}.building_blocks") and not is_public(package, imported):
                details = graph.get_import_details(importer=module, imported=imported) or [{}]
                found += [f"{module}:{d.get('line_number', '?')} imports {imported}" for d in details]
    return found


class BoundedContextsContract(Contract):
    """Contexts are independent and ``building_blocks`` imports none (``root`` names the package)."""

    type_name = "bounded_contexts"

    root = fields.StringField()

    def check(self, graph: grimp.ImportGraph, verbose: bool) -> ContractCheck:
        del verbose
        package = str(self.root)
        violations = [
            *cross_context_imports(graph, package),
            *building_block_imports_of_contexts(graph, package),
        ]
        return ContractCheck(
            kept=not violations,
            metadata={"violations": violations, "contexts": bounded_contexts(graph, package)},
        )

    def render_broken_contract(self, check: ContractCheck) -> None:
        for violation in check.metadata["violations"]:
            output.print_error(violation)
            output.new_line()
        output.print(
            "Share integration events through the contracts package and react to them in a "
            "consumer; keep context code out of building_blocks."
        )


class PublicSurfaceContract(Contract):
    """Contexts import from the building blocks only its public surface and its domain."""

    type_name = "public_surface"

    root = fields.StringField()

    def check(self, graph: grimp.ImportGraph, verbose: bool) -> ContractCheck:
        del verbose
        violations = private_building_block_imports(graph, str(self.root))
        return ContractCheck(kept=not violations, metadata={"violations": violations})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for violation in check.metadata["violations"]:
            output.print_error(violation)
            output.new_line()
        output.print(
            "Import it from building_blocks.public (or building_blocks.domain in a domain module); "
            "if it is not there, it is internal: ask for it to be made public instead."
        )
