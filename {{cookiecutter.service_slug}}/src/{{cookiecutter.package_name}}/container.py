"""The composition root: the kit's container (``outbox_kit.runtime.container``) given this
service's settings and its bounded contexts (every folder of ``contexts/`` with a ``module.py``).

A provider of the service's own (a client for another service, say) goes on :class:`Container`;
tests override a provider (``container.settings.override(...)``) instead of patching modules.
"""

from __future__ import annotations

import importlib

from dependency_injector import providers
from outbox_kit.application.handlers import Module, discover_modules, import_table_modules
from outbox_kit.runtime.container import OutboxContainer
from outbox_kit.runtime.settings import ServiceSettings

from .settings import Settings


def build_modules() -> list[Module]:
    """The bounded contexts under ``contexts/``, with their tables known to SQLModel."""
    modules = discover_modules(importlib.import_module(".contexts", __package__))
    import_table_modules(modules)
    return modules


class Container(OutboxContainer):
    """Every long-lived object of the service, built once per process."""


def build_container(settings: ServiceSettings | None = None) -> Container:
    """A container for ``settings`` (read from the environment when omitted)."""
    return Container(
        settings=providers.Singleton(Settings) if settings is None else providers.Object(settings),
        modules=providers.Singleton(build_modules),
    )
