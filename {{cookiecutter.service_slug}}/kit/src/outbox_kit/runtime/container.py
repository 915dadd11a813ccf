"""The composition of an outbox service: every long-lived object of a process, built lazily from
its settings and its bounded contexts, in one dependency-injector container.

A service derives its container from :class:`OutboxContainer` (its own providers go there) and
builds it with the two things only it knows: ``settings`` (its :class:`ServiceSettings`) and
``modules`` (its bounded contexts, :func:`~outbox_kit.application.handlers.discover_modules`).
Tests override a provider (``container.settings.override(...)``) instead of patching modules. The
contexts' messages and handlers are registered, and the registry validated, when first asked
for, so a duplicate name or a broken upcaster chain stops the service before it touches a row.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from datetime import timedelta

from dependency_injector import containers, providers
from prometheus_fastapi_instrumentator import Instrumentator
from prometheus_fastapi_instrumentator import metrics as http_metrics

from outbox_kit.application.handlers import HandlerRegistry, Module, collect_adapters
from outbox_kit.application.messages import MessageRegistry
from outbox_kit.application.observability import (
    NoTracing,
    OpenTelemetryTracing,
    RelayMetrics,
    Tracing,
    system_clock,
)
from outbox_kit.consume.bus import InProcessBus
from outbox_kit.consume.inbox import ConsumePipeline
from outbox_kit.operations.admin import RelayAdministration
from outbox_kit.operations.retention import RetentionCleaner, RetentionPolicy
from outbox_kit.persistence.database import Database
from outbox_kit.persistence.tables import INTERNAL_COMMANDS, OUTBOX, PolledTable
from outbox_kit.persistence.unit_of_work import RelayWriter, SqlUnitOfWorkFactory, WakeSignal, notify_channel
from outbox_kit.processor.cycle import TableSource
from outbox_kit.processor.deliverers import CommandDeliverer, OutboxDeliverer
from outbox_kit.processor.in_process import LocalDispatcher
from outbox_kit.processor.processor import Deliverer, PostgresListener, SourceSettings
from outbox_kit.runtime.http import ClaimNames, ProviderKeys, SharedSecretTokens, TokenService
from outbox_kit.runtime.settings import ServiceSettings, TracingBackend
from outbox_kit.runtime.worker import Worker
from outbox_kit.transports.bus import CircuitBreaker, DirectPublisher, MessageBus
from outbox_kit.transports.envelope import Signer

log = logging.getLogger(__name__)

# -- the contexts' messages and handlers -------------------------------------------------------


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


# -- the relay: the row writer, the in-process dispatcher, the polled sources, retention ------


def instance_id(settings: ServiceSettings) -> str:
    return settings.application.instance_id or f"{socket.gethostname()}:{os.getpid()}"


def build_writer(
    settings: ServiceSettings, registry: MessageRegistry, handlers: HandlerRegistry, database: Database
) -> RelayWriter:
    return RelayWriter(
        registry=registry,
        handlers=handlers,
        processing_delay=timedelta(seconds=settings.outbox.processing_delay_seconds),
        lease=timedelta(seconds=settings.outbox.lease_seconds),
        immediate_dispatch=settings.outbox.immediate_dispatch,
        instance_id=instance_id(settings),
        namespace=settings.application.namespace,
        dialect=database.dialect,
    )


def build_dispatcher(
    settings: ServiceSettings,
    handlers: HandlerRegistry,
    registry: MessageRegistry,
    metrics: RelayMetrics,
    *,
    units: Callable[[], SqlUnitOfWorkFactory],
    bus: Callable[[], MessageBus],
) -> LocalDispatcher:
    """The in-process dispatcher; it reaches the factory and the bus through their providers
    (they are built after it), and publishes directly only when the outbox is off."""
    outbox = settings.outbox
    return LocalDispatcher(
        handlers,
        units=units,
        max_cascade_depth=outbox.max_cascade_depth,
        lease_seconds=outbox.lease_seconds,
        delivery_timeout_seconds=outbox.delivery_timeout_seconds,
        notify_channel=notify_channel(settings.application.namespace),
        shutdown_timeout_seconds=outbox.shutdown_timeout_seconds,
        publish_direct=DirectPublisher(bus, registry),
        metrics=metrics,
    )


def source_settings(settings: ServiceSettings) -> SourceSettings:
    return SourceSettings.of(settings.outbox, single_writer=not settings.database.is_postgresql)


def build_sources(  # noqa: PLR0917 (the container passes providers positionally)
    settings: ServiceSettings,
    database: Database,
    metrics: RelayMetrics,
    outbox_deliverer: OutboxDeliverer,
    command_deliverer: CommandDeliverer,
    tracing: Tracing,
) -> list[TableSource]:
    """The tables this process drains: internal commands always, the outbox when enabled."""
    drained: list[tuple[PolledTable, Deliverer]] = [(INTERNAL_COMMANDS, command_deliverer)]
    if settings.message_bus.outbox_enabled:
        drained.insert(0, (OUTBOX, outbox_deliverer))
    return [
        TableSource(
            name=polled.name,
            table=polled.table,
            name_column=polled.name_column,
            deliverer=deliverer,
            settings=source_settings(settings),
            database=database,
            clock=system_clock,
            instance_id=instance_id(settings),
            metrics=metrics,
            tracing=tracing,
        )
        for polled, deliverer in drained
    ]


def retention_policy(settings: ServiceSettings) -> RetentionPolicy:
    return RetentionPolicy.of(
        settings.outbox, settings.inbox, idempotency_key_hours=settings.api.idempotency_key_retention_hours
    )


def build_listener(settings: ServiceSettings, wake: WakeSignal) -> PostgresListener | None:
    if not settings.database.is_postgresql:
        return None
    dsn = settings.database.url.replace("postgresql+asyncpg://", "postgresql://", 1)
    return PostgresListener(dsn, notify_channel(settings.application.namespace), wake)


# -- the edges: the message bus and its signer, bearer tokens, tracing, HTTP metrics ----------


def build_signer(settings: ServiceSettings) -> Signer:
    bus = settings.message_bus
    keys = {kid: secret.get_secret_value() for kid, secret in bus.signing_keys.items()}
    return Signer(keys, bus.active_key_id, allow_unsigned=bus.allow_unsigned or not keys)


def build_bus(  # noqa: PLR0917 (the container passes providers positionally)
    settings: ServiceSettings,
    handlers: HandlerRegistry,
    registry: MessageRegistry,
    pipeline: ConsumePipeline,
    signer: Signer,
    metrics: RelayMetrics,
    tracing: Tracing,
) -> MessageBus:
    if not settings.message_bus.is_broker:
        return InProcessBus(
            handlers=handlers,
            registry=registry,
            pipeline=pipeline,
            signer=signer,
            handler_timeout_seconds=settings.message_bus.handler_timeout_seconds,
        )
    from outbox_kit.consume.bus import FastStreamBus  # noqa: PLC0415

    return FastStreamBus(
        settings=settings.message_bus,
        namespace=settings.application.namespace,
        handlers=handlers,
        registry=registry,
        pipeline=pipeline,
        signer=signer,
        metrics=metrics,
        tracer_provider=tracing.tracer_provider,
    )


def build_tracing(settings: ServiceSettings) -> Tracing:
    if settings.telemetry.tracing is TracingBackend.OTEL:
        return OpenTelemetryTracing(service_name=os.environ.get("OTEL_SERVICE_NAME") or settings.service_slug)
    return NoTracing()


def build_database(settings: ServiceSettings, tracing: Tracing) -> Database:
    database = Database(settings.database)
    tracing.trace_statements(database.engine.sync_engine)  # the requests' and handlers' engine
    return database


def build_tokens(settings: ServiceSettings) -> TokenService:
    auth = settings.auth
    provider = None
    if auth.uses_provider:
        provider = ProviderKeys(
            jwks_url=auth.jwks_url,
            issuer=auth.oidc_issuer,
            cache_seconds=auth.jwks_cache_seconds,
            timeout_seconds=auth.jwks_timeout_seconds,
        )
    shared = SharedSecretTokens.NEVER if settings.is_production else SharedSecretTokens.LOOPBACK
    return TokenService(
        secret=auth.jwt_secret.get_secret_value(),
        algorithm=auth.jwt_algorithm,
        issuer=auth.expected_issuer,
        audience=auth.jwt_audience,
        ttl=timedelta(minutes=auth.token_ttl_minutes),
        clock=system_clock,
        claims=ClaimNames(user=auth.user_claim, tenant=auth.tenant_claim, roles=auth.roles_claim),
        provider=provider,
        provider_algorithms=auth.provider_algorithms,
        shared_secret_tokens=shared,
    )


# The probes and the scrape would dominate the HTTP figures; they are watched by other means.
UNMEASURED_ROUTES = ["/metrics", "/livez", "/readyz"]


def build_http_metrics(metrics: RelayMetrics) -> Instrumentator:
    """HTTP metrics per route (``http_requests_total`` by handler, method and status, durations,
    sizes) from prometheus-fastapi-instrumentator, in the service's registry.

    Its metrics are made here, once per container: an app built twice on one container (tests
    do) shares them instead of registering them twice."""
    instrumentator = Instrumentator(
        registry=metrics.registry,
        should_group_status_codes=False,  # a 401 and a 409 mean different things
        excluded_handlers=UNMEASURED_ROUTES,
    )
    return instrumentator.add(http_metrics.default(registry=metrics.registry))


# -- the container -----------------------------------------------------------------------------


class OutboxContainer(containers.DeclarativeContainer):
    """Every long-lived object of an outbox service, built once per process. ``settings`` and
    ``modules`` are the service's to give (``OutboxContainer(settings=..., modules=...)``)."""

    settings = providers.Dependency(instance_of=ServiceSettings)
    modules = providers.Dependency(instance_of=list)
    clock = providers.Object(system_clock)
    registry = providers.Singleton(build_registry, modules)
    handlers = providers.Singleton(build_handlers, modules)
    metrics = providers.Singleton(RelayMetrics)
    tracing = providers.Singleton(build_tracing, settings)
    wake = providers.Singleton(WakeSignal)
    database = providers.Singleton(build_database, settings, tracing)
    writer = providers.Singleton(build_writer, settings, registry, handlers, database)
    dispatcher = providers.Singleton(build_dispatcher, settings, handlers, registry, metrics)
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
        notify_channel=providers.Callable(notify_channel, settings.provided.application.namespace),
    )
    # The unit of work factory and the bus each need the dispatcher: it is given their providers,
    # to reach them on use. (Not ``providers.Self``: it does not follow a derived container.)
    dispatcher.add_kwargs(units=units_of_work.provider, bus=bus.provider)
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


# -- start-up warnings -------------------------------------------------------------------------


def warn_about_unsafe_configuration(settings: ServiceSettings, units: SqlUnitOfWorkFactory) -> None:
    """Warn about configurations that silently lose or duplicate messages."""
    bus = settings.message_bus
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


def warn_when_replays_would_turn_stale(settings: ServiceSettings) -> None:
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
