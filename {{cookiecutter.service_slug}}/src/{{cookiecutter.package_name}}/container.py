"""The composition root: the only place that names concrete adapters and wires them.

Everything is built lazily from :class:`Settings`; tests override a provider
(``container.settings.override(...)``) instead of patching modules. Bounded contexts are
discovered (every folder of ``contexts/`` with a ``module.py``), their messages registered, their handlers
registered, and the registry validated at start-up, so a duplicate name or a broken upcaster
chain stops the service before it touches a row.
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
from datetime import timedelta
from types import ModuleType

from dependency_injector import containers, providers

from .about import SERVICE_SLUG
from .building_blocks.application.handlers import HandlerRegistry
from .building_blocks.application.module import (
    Module,
    collect_adapters,
    discover_modules,
    import_table_modules,
)
from .building_blocks.application.registry import MessageRegistry
from .building_blocks.brokers.in_process import InProcessBus
from .building_blocks.commands.deliverer import COMMAND_TABLE, CommandDeliverer
from .building_blocks.inbox.pipeline import ConsumePipeline
from .building_blocks.kernel.clock import system_clock
from .building_blocks.kernel.metrics import RelayMetrics
from .building_blocks.kernel.tracing import NoTracing, OpenTelemetryTracing, Tracing
from .building_blocks.messaging.bus import MessageBus
from .building_blocks.messaging.circuit import CircuitBreaker
from .building_blocks.messaging.direct import DirectPublisher
from .building_blocks.messaging.envelope import Signer
from .building_blocks.operations.admin import OutboxAdministration
from .building_blocks.operations.retention import RetentionCleaner, RetentionPolicy
from .building_blocks.outbox.deliverer import OutboxDeliverer
from .building_blocks.outbox.in_process import LocalDispatcher
from .building_blocks.persistence.database import Database
from .building_blocks.polling.ports import Deliverer, SourceSettings
from .building_blocks.polling.source import TableSource
from .building_blocks.polling.wake import PostgresListener, WakeSignal
from .building_blocks.runtime.worker import Worker
from .building_blocks.unit_of_work.capture import OUTBOX_TABLE, RelayWriter, notify_channel
from .building_blocks.unit_of_work.factory import UnitOfWorkFactory
from .building_blocks.web.auth import TokenService
from .settings import Settings
from .settings import Tracing as TracingChoice

log = logging.getLogger(__name__)


def _contexts() -> ModuleType:
    return importlib.import_module(f"{__package__ or __name__.rpartition('.')[0]}.contexts")


def build_modules() -> list[Module]:
    modules = discover_modules(_contexts())
    import_table_modules(modules)
    return modules


def build_registry(modules: list[Module]) -> MessageRegistry:
    registry = MessageRegistry()
    for module in modules:
        registry.register(*module.messages)
        for spec in module.upcasters:
            registry.add_upcaster(spec.source, spec.target, spec.upcast)
    registry.validate()
    return registry


def build_handlers(modules: list[Module]) -> HandlerRegistry:
    handlers = HandlerRegistry()
    for module in modules:
        if module.register_handlers is not None:
            module.register_handlers(handlers)
    return handlers


def instance_id(settings: Settings) -> str:
    return settings.application.instance_id or f"{socket.gethostname()}:{os.getpid()}"


def build_writer(
    settings: Settings, registry: MessageRegistry, handlers: HandlerRegistry, database: Database
) -> RelayWriter:
    return RelayWriter(
        registry=registry,
        handlers=handlers,
        processing_delay=timedelta(seconds=settings.outbox.processing_delay_seconds),
        lease=timedelta(seconds=settings.outbox.lease_seconds),
        immediate_dispatch=settings.outbox.immediate_dispatch,
        instance_id=instance_id(settings),
        namespace=settings.application.resolved_namespace,
        dialect=database.dialect,
    )


def build_signer(settings: Settings) -> Signer:
    bus = settings.message_bus
    keys = {kid: secret.get_secret_value() for kid, secret in bus.signing_keys.items()}
    return Signer(keys, bus.active_key_id, allow_unsigned=bus.allow_unsigned or not keys)


def build_dispatcher(
    container: Container,
    settings: Settings,
    handlers: HandlerRegistry,
    registry: MessageRegistry,
    metrics: RelayMetrics,
) -> LocalDispatcher:
    """The in-process dispatcher; it reaches the factory and the bus through their providers
    (they are built after it), and publishes directly only when the outbox is off."""
    outbox = settings.outbox
    return LocalDispatcher(
        handlers,
        units=container.units_of_work,
        max_cascade_depth=outbox.max_cascade_depth,
        lease_seconds=outbox.lease_seconds,
        notify_channel=notify_channel(settings.application.resolved_namespace),
        shutdown_timeout_seconds=outbox.shutdown_timeout_seconds,
        publish_direct=DirectPublisher(container.bus, registry),
        metrics=metrics,
    )


def build_bus(  # noqa: PLR0917 (the container passes providers positionally)
    settings: Settings,
    handlers: HandlerRegistry,
    registry: MessageRegistry,
    pipeline: ConsumePipeline,
    signer: Signer,
    metrics: RelayMetrics,
) -> MessageBus:
    if not settings.message_bus.is_broker:
        return InProcessBus(handlers=handlers, registry=registry, pipeline=pipeline, signer=signer)
    from .building_blocks.brokers.faststream_bus import FastStreamBus  # noqa: PLC0415

    return FastStreamBus(
        settings=settings.message_bus,
        namespace=settings.application.resolved_namespace,
        handlers=handlers,
        registry=registry,
        pipeline=pipeline,
        signer=signer,
        metrics=metrics,
    )


def source_settings(settings: Settings) -> SourceSettings:
    o = settings.outbox
    # SQLite has one writer: concurrent deliveries would only queue on its lock.
    concurrency = o.delivery_concurrency if settings.database.is_postgresql else 1
    return SourceSettings(
        batch_size=o.batch_size,
        delivery_concurrency=concurrency,
        claim_window=o.effective_claim_window,
        lease_seconds=o.lease_seconds,
        max_retries=o.max_retries,
        retry_backoff_base_seconds=o.retry_backoff_base_seconds,
        shutdown_timeout_seconds=o.shutdown_timeout_seconds,
    )


def build_sources(  # noqa: PLR0917 (the container passes providers positionally)
    settings: Settings,
    database: Database,
    metrics: RelayMetrics,
    outbox_deliverer: OutboxDeliverer,
    command_deliverer: CommandDeliverer,
    tracing: Tracing,
) -> list[TableSource]:
    """The tables this process drains: internal commands always, the outbox when enabled."""
    shared = {
        "settings": source_settings(settings),
        "database": database,
        "clock": system_clock,
        "instance_id": instance_id(settings),
        "metrics": metrics,
        "tracing": tracing,
    }
    pairs: list[tuple[str, object, str, Deliverer]] = [
        ("internal_commands", COMMAND_TABLE, "command_name", command_deliverer)
    ]
    if settings.message_bus.outbox_enabled:
        pairs.insert(0, ("outbox", OUTBOX_TABLE, "event_name", outbox_deliverer))
    return [
        TableSource(name=name, table=table, name_column=column, deliverer=deliverer, **shared)  # type: ignore[arg-type]
        for name, table, column, deliverer in pairs
    ]


def build_tracing(settings: Settings) -> Tracing:
    if settings.telemetry.tracing is TracingChoice.OTEL:
        return OpenTelemetryTracing(service_name=os.environ.get("OTEL_SERVICE_NAME") or SERVICE_SLUG)
    return NoTracing()


def build_tokens(settings: Settings) -> TokenService:
    auth = settings.auth
    return TokenService(
        secret=auth.jwt_secret.get_secret_value(),
        algorithm=auth.jwt_algorithm,
        issuer=auth.jwt_issuer,
        audience=auth.jwt_audience,
        ttl=timedelta(minutes=auth.token_ttl_minutes),
        clock=system_clock,
    )


def retention_policy(settings: Settings) -> RetentionPolicy:
    return RetentionPolicy(
        retention_days=settings.outbox.retention_days,
        dead_letter_days=settings.outbox.dead_letter_window_days,
        inbox_retention_days=settings.inbox.retention_days,
        batch_size=settings.outbox.cleanup_batch_size,
    )


def build_listener(settings: Settings, wake: WakeSignal) -> PostgresListener | None:
    if not settings.database.is_postgresql:
        return None
    dsn = settings.database.url.replace("postgresql+asyncpg://", "postgresql://", 1)
    return PostgresListener(dsn, notify_channel(settings.application.resolved_namespace), wake)


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
    dispatcher = providers.Singleton(build_dispatcher, __self__, settings, handlers, registry, metrics)
    units_of_work = providers.Singleton(
        UnitOfWorkFactory,
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
    bus = providers.Singleton(build_bus, settings, handlers, registry, pipeline, signer, metrics)
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
        OutboxAdministration,
        database=database,
        clock=clock,
        wake=wake.provided.set,
        notify_channel=providers.Callable(notify_channel, settings.provided.application.resolved_namespace),
    )
    tokens = providers.Singleton(build_tokens, settings)
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
        cleanup_interval_seconds=settings.provided.outbox.cleanup_interval_seconds,
        metrics_interval_seconds=settings.provided.outbox.metrics_interval_seconds,
        shutdown_timeout_seconds=settings.provided.outbox.shutdown_timeout_seconds,
    )


def build_container(settings: Settings | None = None) -> Container:
    """A container for ``settings`` (read from the environment when omitted)."""
    container = Container()
    if settings is not None:
        container.settings.override(providers.Object(settings))
    return container


def startup_diagnostics(container: Container) -> None:
    """Warn about configurations that silently lose or duplicate messages (ADR-100, RCommon)."""
    settings = container.settings()
    bus = settings.message_bus
    units = container.units_of_work()
    if units.outbox_enabled != bus.outbox_enabled or not isinstance(units.writer, RelayWriter):
        log.warning(
            "The outbox is %s by settings but the composition root wires a unit of work with "
            "the outbox %s: domain and integration events would bypass it. Restore the "
            "container's units_of_work provider.",
            "ON" if bus.outbox_enabled else "OFF",
            "ON" if units.outbox_enabled else "OFF",
        )
    if bus.is_broker and bus.enable_inbox is False:
        log.warning(
            "MESSAGE_BUS__ENABLE_INBOX=false with the %s transport: broker redeliveries will run "
            "handlers twice unless every handler is idempotent on its own.",
            bus.transport,
        )
    warn_when_replays_would_turn_stale(settings)
    if bus.is_broker and not bus.signing_keys:
        log.warning(
            "No MESSAGE_BUS__SIGNING_KEYS: context headers are unsigned, so any publisher on the "
            "broker can claim any tenant or user. Set signing keys before production."
        )
    elif bus.is_broker and bus.allow_unsigned:
        log.warning(
            "MESSAGE_BUS__ALLOW_UNSIGNED=true: messages are signed, but unsigned ones are accepted "
            "too, so any publisher on the broker can still claim any tenant or user. Turn it off "
            "once every producer signs."
        )


def warn_when_replays_would_turn_stale(settings: Settings) -> None:
    """Consumers refuse a message older than ``INBOX__RETENTION_DAYS`` (its duplicate could no
    longer be recognised); a dead letter replayed late in its window must not be one."""
    inbox_days = settings.inbox.retention_days
    dead_letter_days = settings.outbox.dead_letter_window_days
    if inbox_days and (dead_letter_days == 0 or inbox_days <= dead_letter_days):
        kept = "forever" if dead_letter_days == 0 else f"{dead_letter_days} days"
        log.warning(
            "INBOX__RETENTION_DAYS=%s does not exceed how long outbox dead letters are kept (%s): "
            "a dead letter replayed late reaches its consumers as stale and is dead-lettered "
            "there. Keep the inbox longer than OUTBOX__DEAD_LETTER_RETENTION_DAYS (0 = "
            "OUTBOX__RETENTION_DAYS) plus the time a replay takes.",
            inbox_days,
            kept,
        )
