"""The contract between a bounded context and the composition root.

Each bounded context exposes ``contexts/<name>/module.py`` with a ``module()`` function
returning a :class:`Module`. The container discovers them (any folder of ``contexts/`` with a
``module.py``), so adding a context needs no edit elsewhere, and removing the example is
deleting its folders.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
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
