"""An import-linter contract type for the bounded contexts, found the way the container finds them.

import-linter's built-in contracts name their modules, so a contract listing ``orders`` and
``notifications`` would not cover the context a user adds next, and would need the template to
write the list. This contract type (registered in ``pyproject.toml`` under ``contract_types``)
discovers the contexts from the import graph instead: every sub-package of the root with a
``module.py``, except the framework, the entrypoints and the published contracts. It checks,
indirect imports included, that

* no bounded context imports another one (they talk through integration events), and
* ``building_blocks`` imports no bounded context (the framework knows none of its users).

``lint-imports`` runs it with the built-in contracts (``make lint``), and the architecture tier
runs ``lint-imports``; the functions below are also what ``test_layering`` calls.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import grimp
from importlinter import Contract, ContractCheck, fields, output

from {{ cookiecutter.package_name }}.building_blocks.application.module import (
    NOT_CONTEXTS,
)

SHARED = NOT_CONTEXTS | {"contracts"}


def bounded_contexts(graph: grimp.ImportGraph, package: str) -> list[str]:
    """Sub-packages of ``package`` with a ``module.py``, except the shared ones."""
    return sorted(
        module.split(".")[1]
        for module in graph.modules
        if module.startswith(f"{package}.")
        and module.count(".") == 2
        and module.endswith(".module")
        and module.split(".")[1] not in SHARED
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
    return import_chains(graph, package, itertools.permutations(bounded_contexts(graph, package), 2))


def building_block_imports_of_contexts(graph: grimp.ImportGraph, package: str) -> list[str]:
    contexts = bounded_contexts(graph, package)
    return import_chains(graph, package, [("building_blocks", context) for context in contexts])


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
