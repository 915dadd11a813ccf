"""The contract between a bounded context and the composition root.

Each bounded context exposes ``contexts/<name>/module.py`` with a ``module()`` function
returning a :class:`Module`. The container discovers them (any folder of ``contexts/`` with a
``module.py``), so adding a context needs no edit elsewhere, and removing the example is
deleting its folders.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ..domain.events import Message
from .handlers import HandlerRegistry
from .registry import Upcaster
from .unit_of_work import Adapter

if TYPE_CHECKING:
    from fastapi import APIRouter  # an external type only: no import cycle to break


@dataclass(frozen=True)
class UpcasterSpec:
    """Read payloads stored under ``source`` as ``target`` (one version step)."""

    source: str
    target: str
    upcast: Upcaster


@dataclass(frozen=True)
class Module:
    """What a bounded context contributes: messages, handlers, HTTP routes, table modules."""

    name: str
    messages: Sequence[type[Message]] = ()
    upcasters: Sequence[UpcasterSpec] = ()
    register_handlers: Callable[[HandlerRegistry], None] | None = None
    routers: Sequence[APIRouter] = ()
    table_modules: Sequence[str] = field(default_factory=tuple)
    adapters: Mapping[type[Any], Adapter] = field(default_factory=dict)
    """Port (a Protocol the use cases ask ``uow.repository`` for) -> adapter class."""


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


def collect_adapters(modules: Sequence[Module]) -> dict[type[Any], Adapter]:
    """Every context's port -> adapter map; one port claimed twice is refused."""
    adapters: dict[type[Any], Adapter] = {}
    for module in modules:
        for port, adapter in module.adapters.items():
            if port in adapters:
                msg = f"port {port.__qualname__} has two adapters (module {module.name})"
                raise TypeError(msg)
            adapters[port] = adapter
    return adapters


def import_table_modules(modules: Sequence[Module]) -> None:
    """Import every context's table definitions so SQLModel's metadata knows them."""
    for module in modules:
        for name in module.table_modules:
            importlib.import_module(name)
