"""Finding the bounded contexts: every folder of contexts/ with a module.py defining module() ->
Module, imported in name order, with its table modules."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Sequence
from types import ModuleType

from .module import Module


def discover_modules(contexts: ModuleType) -> list[Module]:
    """Import ``<contexts>.<name>.module`` for every context folder, in name order (a folder
    without ``module.py`` is not a context and is skipped)."""
    found: list[Module] = []
    for info in sorted(pkgutil.iter_modules(contexts.__path__), key=lambda i: i.name):
        if not info.ispkg:
            continue
        try:
            contributed = importlib.import_module(f"{contexts.__name__}.{info.name}.module")
        except ModuleNotFoundError as error:
            if error.name == f"{contexts.__name__}.{info.name}.module":
                continue
            raise
        factory = getattr(contributed, "module", None)
        if not callable(factory):
            msg = f"{contributed.__name__} must define module() -> Module"
            raise TypeError(msg)
        found.append(factory())
    return found


def import_table_modules(modules: Sequence[Module]) -> None:
    """Import every context's table definitions so SQLModel's metadata knows them."""
    for module in modules:
        for name in module.table_modules:
            importlib.import_module(name)
