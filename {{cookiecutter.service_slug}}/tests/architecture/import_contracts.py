"""Import-linter contract types for the bounded contexts, found the way the container finds them.

import-linter's built-in contracts name their modules, so a contract listing ``orders`` and
``notifications`` would not cover the context a user adds next. These contract types (registered
in ``pyproject.toml`` under ``contract_types``) discover the contexts from the import graph
instead: every folder of ``contexts/`` with a ``module.py``.

* ``bounded_contexts``: no context imports another one (they talk through integration events),
  and the kit imports no context (the framework knows none of its users); indirect imports
  included, each reported with its chain;
* ``public_surface``: a context (and ``contracts/``) imports from the kit only ``outbox_kit.public``
  and ``outbox_kit.domain``: everything else is internal and may change in a new kit version
  without breaking a context. Reported with file and line.

Each takes ``root`` (the service's package) and ``kit`` (the kit's package, ``outbox_kit``).

``lint-imports`` runs them with the built-in contracts (``make lint``), and the architecture tier
runs ``lint-imports``; the functions below are also what ``test_layering`` calls.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import grimp
from importlinter import Contract, ContractCheck, fields, output

CONTEXTS = "contexts"
KIT = "outbox_kit"
PUBLIC = ("public", "domain")  # of the kit


def bounded_contexts(graph: grimp.ImportGraph, package: str) -> list[str]:
    """The folders of ``<package>.contexts`` with a ``module.py``."""
    prefix = f"{package}.{CONTEXTS}."
    return sorted(
        module.removeprefix(prefix).partition(".")[0]
        for module in graph.modules
        if module.startswith(prefix) and module.count(".") == 3 and module.endswith(".module")
    )


def import_chains(graph: grimp.ImportGraph, package: str, pairs: Iterable[tuple[str, str]]) -> list[str]:
    """The shortest import chains (direct or not) between packages, one line per chain; the
    pair is named short (without ``package.``), the chain in full."""
    found: list[str] = []
    for importer, imported in pairs:
        chains = graph.find_shortest_chains(importer=importer, imported=imported, as_packages=True)
        pair = f"{importer.removeprefix(f'{package}.')} -> {imported.removeprefix(f'{package}.')}"
        found += [f"{pair}: {' -> '.join(chain)}" for chain in sorted(chains)]
    return found


def context_packages(graph: grimp.ImportGraph, package: str) -> list[str]:
    return [f"{package}.{CONTEXTS}.{name}" for name in bounded_contexts(graph, package)]


def cross_context_imports(graph: grimp.ImportGraph, package: str) -> list[str]:
    return import_chains(graph, package, itertools.permutations(context_packages(graph, package), 2))


def kit_imports_of_contexts(graph: grimp.ImportGraph, package: str, kit: str = KIT) -> list[str]:
    return import_chains(graph, package, [(kit, context) for context in context_packages(graph, package)])


def is_public(kit: str, module: str) -> bool:
    return any(module == f"{kit}.{p}" or module.startswith(f"{kit}.{p}.") for p in PUBLIC)


def private_kit_imports(graph: grimp.ImportGraph, package: str, kit: str = KIT) -> list[str]:
    """Direct imports of an internal kit module by a context or the contracts."""
    users = (f"{package}.{CONTEXTS}.", f"{package}.contracts")
    found: list[str] = []
    for module in sorted(m for m in graph.modules if m.startswith(users)):
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            if (imported == kit or imported.startswith(f"{kit}.")) and not is_public(kit, imported):
                details = graph.get_import_details(importer=module, imported=imported) or [{}]
                found += [f"{module}:{d.get('line_number', '?')} imports {imported}" for d in details]
    return found


class BoundedContextsContract(Contract):
    """Contexts are independent and the kit imports none (``root``: the service's package,
    ``kit``: the kit's)."""

    type_name = "bounded_contexts"

    root = fields.StringField()
    kit = fields.StringField()

    def check(self, graph: grimp.ImportGraph, verbose: bool) -> ContractCheck:
        del verbose
        package = str(self.root)
        violations = [
            *cross_context_imports(graph, package),
            *kit_imports_of_contexts(graph, package, str(self.kit)),
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
            "consumer; keep context code out of the kit."
        )


class PublicSurfaceContract(Contract):
    """Contexts import from the kit only its public surface and its domain."""

    type_name = "public_surface"

    root = fields.StringField()
    kit = fields.StringField()

    def check(self, graph: grimp.ImportGraph, verbose: bool) -> ContractCheck:
        del verbose
        violations = private_kit_imports(graph, str(self.root), str(self.kit))
        return ContractCheck(kept=not violations, metadata={"violations": violations})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for violation in check.metadata["violations"]:
            output.print_error(violation)
            output.new_line()
        output.print(
            "Import it from outbox_kit.public (or outbox_kit.domain in a domain module); "
            "if it is not there, it is internal: ask for it to be made public instead."
        )
