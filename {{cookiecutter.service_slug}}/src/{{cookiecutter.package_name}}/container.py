"""The composition root: the only place that names concrete adapters and wires them.

Everything is built lazily from :class:`Settings`; tests override a provider
(``container.settings.override(...)``) instead of patching modules. Bounded contexts are
discovered (every folder of ``contexts/`` with a ``module.py``), their messages registered, their handlers
registered, and the registry validated at start-up, so a duplicate name or a broken upcaster
chain stops the service before it touches a row.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from dependency_injector import containers, providers
from outbox_kit.application.handlers import collect_adapters
from outbox_kit.application.observability import RelayMetrics, system_clock
from outbox_kit.consume.inbox import ConsumePipeline
from outbox_kit.operations.admin import RelayAdministration
from outbox_kit.operations.retention import RetentionCleaner
from outbox_kit.persistence.database import Database
from outbox_kit.persistence.unit_of_work import SqlUnitOfWorkFactory, WakeSignal, notify_channel
from outbox_kit.processor.deliverers import CommandDeliverer, OutboxDeliverer
from outbox_kit.runtime.worker import Worker
from outbox_kit.transports.bus import CircuitBreaker

from .composition.diagnostics import warn_about_unsafe_configuration
from .composition.edges import build_bus, build_http_metrics, build_signer, build_tokens, build_tracing
from .composition.modules import build_handlers, build_modules, build_registry
from .composition.relay import build_dispatcher, build_listener, build_sources, build_writer, retention_policy
from .settings import Settings

log = logging.getLogger(__name__)


def _provider(container: Container, name: str) -> Callable[[], Any]:
    """One of ``container``'s providers, to call later (breaks a build-order cycle)."""
    provider: Callable[[], Any] = getattr(container, name)
    return provider


class Container(containers.DeclarativeContainer):
    """Every long-lived object of the service, built once per process."""

    __self__ = providers.Self()
    settings = providers.Singleton(Settings)
    clock = providers.Object(system_clock)
    modules = providers.Singleton(build_modules)
    registry = providers.Singleton(build_registry, modules)
    handlers = providers.Singleton(build_handlers, modules)
    metrics = providers.Singleton(RelayMetrics)
    tracing = providers.Singleton(build_tracing, settings)
    wake = providers.Singleton(WakeSignal)
    database = providers.Singleton(Database, settings.provided.database)
    writer = providers.Singleton(build_writer, settings, registry, handlers, database)
    dispatcher = providers.Singleton(
        build_dispatcher,
        settings,
        handlers,
        registry,
        metrics,
        # the factory and the bus are built after the dispatcher: it reaches them on use
        providers.Callable(_provider, __self__, "units_of_work"),
        providers.Callable(_provider, __self__, "bus"),
    )
    units_of_work = providers.Singleton(
        SqlUnitOfWorkFactory,
        database=database,
        writer=writer,
        after_commit=dispatcher,
        clock=clock,
        wake=wake.provided.set,
        outbox_enabled=settings.provided.message_bus.outbox_enabled,
        adapters=providers.Singleton(collect_adapters, modules),
    )
    signer = providers.Singleton(build_signer, settings)
    pipeline = providers.Singleton(
        ConsumePipeline,
        units=units_of_work,
        registry=registry,
        signer=signer,
        inbox_enabled=settings.provided.message_bus.inbox_enabled,
        metrics=metrics,
        clock=clock,
        inbox_retention_days=settings.provided.inbox.retention_days,
        max_header_bytes=settings.provided.message_bus.max_header_bytes,
        tracing=tracing,
    )
    bus = providers.Singleton(build_bus, settings, handlers, registry, pipeline, signer, metrics, tracing)
    breaker = providers.Singleton(
        CircuitBreaker,
        failure_threshold=settings.provided.message_bus.circuit_failure_threshold,
        reset_seconds=settings.provided.message_bus.circuit_reset_seconds,
        clock=clock,
    )
    outbox_deliverer = providers.Singleton(
        OutboxDeliverer, registry=registry, handlers=handlers, dispatcher=dispatcher, bus=bus, breaker=breaker
    )
    command_deliverer = providers.Singleton(
        CommandDeliverer, registry=registry, handlers=handlers, units=units_of_work
    )
    sources = providers.Singleton(
        build_sources, settings, database, metrics, outbox_deliverer, command_deliverer, tracing
    )
    cleaner = providers.Singleton(
        RetentionCleaner,
        database=database,
        policy=providers.Singleton(retention_policy, settings),
        clock=clock,
        metrics=metrics,
    )
    admin = providers.Singleton(
        RelayAdministration,
        database=database,
        clock=clock,
        wake=wake.provided.set,
        notify_channel=providers.Callable(notify_channel, settings.provided.application.resolved_namespace),
    )
    tokens = providers.Singleton(build_tokens, settings)
    http_metrics = providers.Singleton(build_http_metrics, metrics)
    listener = providers.Singleton(build_listener, settings, wake)
    worker = providers.Singleton(
        Worker,
        sources=sources,
        wake=wake,
        cleaner=cleaner,
        bus=bus,
        database=database,
        metrics=metrics,
        clock=clock,
        listener=listener,
        polling_interval_seconds=settings.provided.outbox.polling_interval_seconds,
        idle_polling_interval_seconds=settings.provided.outbox.idle_polling_interval_seconds,
        cleanup_interval_seconds=settings.provided.outbox.cleanup_interval_seconds,
        metrics_interval_seconds=settings.provided.outbox.metrics_interval_seconds,
        shutdown_timeout_seconds=settings.provided.outbox.shutdown_timeout_seconds,
        liveness_timeout_seconds=settings.provided.liveness_timeout_seconds,
    )


def build_container(settings: Settings | None = None) -> Container:
    """A container for ``settings`` (read from the environment when omitted)."""
    container = Container()
    if settings is not None:
        container.settings.override(providers.Object(settings))
    return container


def startup_diagnostics(container: Container) -> None:
    """Warn about configurations that silently lose or duplicate messages (see ``diagnostics``)."""
    warn_about_unsafe_configuration(container.settings(), container.units_of_work())
