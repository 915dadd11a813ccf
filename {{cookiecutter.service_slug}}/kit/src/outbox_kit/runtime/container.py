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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta

from dependency_injector import containers, providers
from prometheus_fastapi_instrumentator import Instrumentator
from prometheus_fastapi_instrumentator import metrics as http_metrics

from outbox_kit.application.clock import Clock, system_clock
from outbox_kit.application.handlers import HandlerRegistry, Module, collect_adapters
from outbox_kit.application.messages import MessageRegistry
from outbox_kit.application.metrics import RelayMetrics
from outbox_kit.application.tracing import NoTracing, OpenTelemetryTracing, Tracing
from outbox_kit.consume.inbox import ConsumePipeline
from outbox_kit.consume.subscribers import ConsumeWrapper
from outbox_kit.operations.admin import RelayAdministration
from outbox_kit.operations.retention import RetentionCleaner, RetentionPolicy
from outbox_kit.persistence.database import Database, DatabaseSettings, is_database_outage
from outbox_kit.persistence.tables import (
    DEFAULT_SOURCE,
    INTERNAL_COMMANDS,
    OUTBOX,
    PolledTable,
    qualified_name,
)
from outbox_kit.persistence.unit_of_work import SqlUnitOfWorkFactory
from outbox_kit.persistence.writer import RelayWriter, WakeSignal, notify_channel
from outbox_kit.processor.cycle import TableSource
from outbox_kit.processor.deliverers import CommandDeliverer, OutboxDeliverer
from outbox_kit.processor.in_process import LocalDispatcher
from outbox_kit.processor.processor import Deliverer, PostgresListener, SourceSettings
from outbox_kit.runtime.identity_provider import ProviderKeys
from outbox_kit.runtime.settings import ServiceSettings, TracingBackend
from outbox_kit.runtime.sources import DataSource, DataSources, consumer_contexts, plan_sources
from outbox_kit.runtime.tokens import ClaimNames, SharedSecretTokens, TokenService
from outbox_kit.runtime.worker import Worker
from outbox_kit.transports.base import FastStreamTransport
from outbox_kit.transports.bus import CircuitBreaker, DirectPublisher, MessageBus
from outbox_kit.transports.envelope import Signer
from outbox_kit.transports.in_process import InProcessBus
from outbox_kit.transports.settings import EndpointNames, MessageBusSettings, Transport

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
    database: Database,
    clock: Clock,
    wake: Callable[[], None],
    bus: Callable[[], MessageBus],
) -> LocalDispatcher:
    """A source's in-process dispatcher; it reaches the bus through its provider (built after
    it), and publishes directly only when the outbox is off."""
    outbox = settings.outbox
    return LocalDispatcher(
        handlers,
        database=database,
        clock=clock,
        wake=wake,
        max_cascade_depth=outbox.max_cascade_depth,
        lease_seconds=outbox.lease_seconds,
        delivery_timeout_seconds=outbox.delivery_timeout_seconds,
        notify_channel=notify_channel(settings.application.namespace),
        shutdown_timeout_seconds=outbox.shutdown_timeout_seconds,
        publish_direct=DirectPublisher(bus, registry),
        metrics=metrics,
    )


def source_settings(settings: ServiceSettings, database: Database) -> SourceSettings:
    """The processor settings of a table in ``database`` (SQLite has a single writer)."""
    return SourceSettings.of(settings.outbox, single_writer=not database.is_postgresql)


def build_tables(  # noqa: PLR0917 (one source's drained tables, from its parts)
    settings: ServiceSettings,
    source: str,
    database: Database,
    metrics: RelayMetrics,
    outbox_deliverer: OutboxDeliverer,
    command_deliverer: CommandDeliverer,
    tracing: Tracing,
) -> list[TableSource]:
    """The tables this process drains in one source: internal commands always, the outbox when
    enabled. The default source's keep their plain names (``outbox``); another source's carry
    its name (``notifications.outbox``): metrics, logs and the operator commands say which."""
    drained: list[tuple[PolledTable, Deliverer]] = [(INTERNAL_COMMANDS, command_deliverer)]
    if settings.message_bus.outbox_enabled:
        drained.insert(0, (OUTBOX, outbox_deliverer))
    return [
        TableSource(
            name=qualified_name(source, polled.name),
            table=polled.table,
            name_column=polled.name_column,
            deliverer=deliverer,
            settings=source_settings(settings, database),
            database=database,
            clock=system_clock,
            instance_id=instance_id(settings),
            metrics=metrics,
            tracing=tracing,
        )
        for polled, deliverer in drained
    ]


# -- the sources: each one's database and relay parts (planned by ``runtime.sources``) -------


def build_data_sources(
    settings: ServiceSettings,
    modules: list[Module],
    *,
    registry: MessageRegistry,
    handlers: HandlerRegistry,
    metrics: RelayMetrics,
    tracing: Tracing,
    wake: WakeSignal,
    clock: Clock,
    bus: Callable[[], MessageBus],
) -> DataSources:
    plans = plan_sources(settings, modules)
    source_of_context = {context: plan.name for plan in plans for context in plan.contexts}
    source_of_port = {port: source_of_context[m.name] for m in modules for port in m.adapters}
    adapters = collect_adapters(modules)
    built = []
    for plan in plans:
        database = build_database(plan.database, tracing, schema=plan.schema)
        dispatcher = build_dispatcher(
            settings, handlers, registry, metrics, database=database, clock=clock, wake=wake.set, bus=bus
        )
        factory = SqlUnitOfWorkFactory(
            database=database,
            writer=build_writer(settings, registry, handlers, database),
            after_commit=dispatcher,
            clock=clock,
            wake=wake.set,
            outbox_enabled=settings.message_bus.outbox_enabled,
            adapters=adapters,
            source=plan.name,
            foreign_ports={port: there for port, there in source_of_port.items() if there != plan.name},
        )
        cleaner = RetentionCleaner(
            database=database, policy=retention_policy(settings), clock=clock, metrics=metrics
        )
        built.append(DataSource(plan.name, plan.contexts, database, factory, dispatcher, cleaner))
    return DataSources(built, consumer_contexts(modules))


@dataclass(frozen=True)
class SourceDeliverers:
    """What one source's processors deliver with: the outbox's and the internal commands'."""

    outbox: OutboxDeliverer
    commands: CommandDeliverer


def build_deliverers(
    sources: DataSources,
    *,
    registry: MessageRegistry,
    handlers: HandlerRegistry,
    bus: MessageBus,
    breaker: CircuitBreaker,
) -> dict[str, SourceDeliverers]:
    """Each source's deliverers, by source (one publishing breaker: the broker is shared)."""
    return {
        source.name: SourceDeliverers(
            OutboxDeliverer(
                registry=registry,
                handlers=handlers,
                dispatcher=source.dispatcher,
                units=source.units,
                bus=bus,
                breaker=breaker,
            ),
            CommandDeliverer(registry=registry, handlers=handlers, units=source.units),
        )
        for source in sources
    }


def default_outbox_deliverer(deliverers: Mapping[str, SourceDeliverers]) -> OutboxDeliverer:
    return deliverers[DEFAULT_SOURCE].outbox


def default_command_deliverer(deliverers: Mapping[str, SourceDeliverers]) -> CommandDeliverer:
    return deliverers[DEFAULT_SOURCE].commands


def build_all_tables(
    settings: ServiceSettings,
    sources: DataSources,
    deliverers: Mapping[str, SourceDeliverers],
    metrics: RelayMetrics,
    tracing: Tracing,
) -> list[TableSource]:
    """Every polled table of every source (one database each: a source that is down fails only
    its own cycles)."""
    tables: list[TableSource] = []
    for source in sources:
        delivering = deliverers[source.name]
        tables += build_tables(
            settings, source.name, source.database, metrics, delivering.outbox, delivering.commands, tracing
        )
    return tables


def retention_policy(settings: ServiceSettings) -> RetentionPolicy:
    return RetentionPolicy.of(
        settings.outbox, settings.inbox, idempotency_key_hours=settings.api.idempotency_key_retention_hours
    )


def build_listeners(
    settings: ServiceSettings, sources: DataSources, wake: WakeSignal
) -> list[PostgresListener]:
    """One LISTEN connection per PostgreSQL database (a NOTIFY reaches only the listeners of
    its own database; sources in schemas of one database share it)."""
    urls = {source.database.settings.url for source in sources if source.database.is_postgresql}
    channel = notify_channel(settings.application.namespace)
    return [
        PostgresListener(url.replace("postgresql+asyncpg://", "postgresql://", 1), channel, wake)
        for url in sorted(urls)
    ]


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
    """The one port a publish crosses (the in-process bus or a broker transport), with this
    service's consumers attached through the consume wrapper (the way in)."""
    bus_settings = settings.message_bus
    if not bus_settings.is_broker:
        return InProcessBus(
            handlers=handlers,
            registry=registry,
            signer=signer,
            consume=pipeline.consume,
            is_outage=is_database_outage,
        )
    names = EndpointNames(settings.application.namespace, bus_settings.preserve_default_endpoint_names)
    transport = build_transport(bus_settings, names, registry, signer)
    transport.count_in(metrics.registry)
    if tracing.tracer_provider is not None:
        transport.trace_consumes_with(tracing.tracer_provider)
    ConsumeWrapper(settings=bus_settings, pipeline=pipeline, metrics=metrics).subscribe_all(
        transport, handlers.consumers
    )
    return transport


def build_transport(
    settings: MessageBusSettings, names: EndpointNames, registry: MessageRegistry, signer: Signer
) -> FastStreamTransport:
    """The chosen broker's transport, importing only its client library."""
    if settings.transport is Transport.RABBITMQ:
        from outbox_kit.transports.rabbit import RabbitTransport  # noqa: PLC0415

        return RabbitTransport(settings, names, registry, signer)
    if settings.transport is Transport.NATS:
        from outbox_kit.transports.nats import NatsTransport  # noqa: PLC0415

        return NatsTransport(settings, names, registry, signer)
    if settings.transport is Transport.REDIS:
        from outbox_kit.transports.redis import RedisTransport  # noqa: PLC0415

        return RedisTransport(settings, names, registry, signer)
    if settings.transport is Transport.KAFKA:
        from outbox_kit.transports.kafka import KafkaTransport  # noqa: PLC0415

        return KafkaTransport(settings, names, registry, signer)
    msg = f"{settings.transport} is not a broker transport"
    raise ValueError(msg)


def build_tracing(settings: ServiceSettings) -> Tracing:
    if settings.telemetry.tracing is TracingBackend.OTEL:
        return OpenTelemetryTracing(service_name=os.environ.get("OTEL_SERVICE_NAME") or settings.service_slug)
    return NoTracing()


def build_database(settings: DatabaseSettings, tracing: Tracing, *, schema: str | None = None) -> Database:
    database = Database(settings, schema=schema)
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
            refetch_seconds=auth.jwks_refetch_seconds,
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
    # Every source's database and relay parts; the providers below them are the default
    # source's (a service with no second source has only that one).
    data_sources = providers.Singleton(
        build_data_sources,
        settings,
        modules,
        registry=registry,
        handlers=handlers,
        metrics=metrics,
        tracing=tracing,
        wake=wake,
        clock=clock,
    )
    database = providers.Callable(DataSources.default_database, data_sources)
    dispatcher = providers.Callable(DataSources.default_dispatcher, data_sources)
    units_of_work = providers.Callable(DataSources.default_units, data_sources)
    cleaner = providers.Callable(DataSources.default_cleaner, data_sources)
    signer = providers.Singleton(build_signer, settings)
    pipeline = providers.Singleton(
        ConsumePipeline,
        units=data_sources.provided.units_for_consumer,
        registry=registry,
        signer=signer,
        inbox_enabled=settings.provided.message_bus.inbox_enabled,
        metrics=metrics,
        clock=clock,
        handler_timeout_seconds=settings.provided.message_bus.handler_timeout_seconds,
        inbox_retention_days=settings.provided.inbox.retention_days,
        max_header_bytes=settings.provided.message_bus.max_header_bytes,
        tracing=tracing,
        batch_size=settings.provided.message_bus.consume_batch_size,
        batch_concurrency=settings.provided.message_bus.consume_concurrency,
    )
    bus = providers.Singleton(build_bus, settings, handlers, registry, pipeline, signer, metrics, tracing)
    breaker = providers.Singleton(
        CircuitBreaker,
        failure_threshold=settings.provided.message_bus.circuit_failure_threshold,
        reset_seconds=settings.provided.message_bus.circuit_reset_seconds,
        clock=clock,
    )
    deliverers = providers.Singleton(
        build_deliverers, data_sources, registry=registry, handlers=handlers, bus=bus, breaker=breaker
    )
    outbox_deliverer = providers.Callable(default_outbox_deliverer, deliverers)
    command_deliverer = providers.Callable(default_command_deliverer, deliverers)
    sources = providers.Singleton(build_all_tables, settings, data_sources, deliverers, metrics, tracing)
    admin = providers.Singleton(
        RelayAdministration,
        databases=providers.Callable(DataSources.databases, data_sources),
        clock=clock,
        wake=wake.provided.set,
        notify_channel=providers.Callable(notify_channel, settings.provided.application.namespace),
    )
    # The sources' in-process dispatchers publish directly when the outbox is off: they are
    # given the bus's provider, to reach the bus (built after them) on use.
    data_sources.add_kwargs(bus=bus.provider)
    tokens = providers.Singleton(build_tokens, settings)
    http_metrics = providers.Singleton(build_http_metrics, metrics)
    listeners = providers.Singleton(build_listeners, settings, data_sources, wake)
    worker = providers.Singleton(
        Worker,
        sources=sources,
        wake=wake,
        cleaners=providers.Callable(DataSources.cleaners, data_sources),
        bus=bus,
        metrics=metrics,
        clock=clock,
        listeners=listeners,
        polling_interval_seconds=settings.provided.outbox.polling_interval_seconds,
        idle_polling_interval_seconds=settings.provided.outbox.idle_polling_interval_seconds,
        cleanup_interval_seconds=settings.provided.outbox.cleanup_interval_seconds,
        metrics_interval_seconds=settings.provided.outbox.metrics_interval_seconds,
        shutdown_timeout_seconds=settings.provided.outbox.shutdown_timeout_seconds,
        liveness_timeout_seconds=settings.provided.liveness_timeout_seconds,
    )
