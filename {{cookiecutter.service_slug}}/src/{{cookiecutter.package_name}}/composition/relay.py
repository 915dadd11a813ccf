"""The relay's parts: the row writer, the in-process dispatcher, the polled sources, retention
and the PostgreSQL listener."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from datetime import timedelta

from outbox_kit.application.handlers import HandlerRegistry
from outbox_kit.application.messages import MessageRegistry
from outbox_kit.application.observability import RelayMetrics, Tracing, system_clock
from outbox_kit.operations.retention import RetentionPolicy
from outbox_kit.persistence.database import Database
from outbox_kit.persistence.tables import INTERNAL_COMMANDS, OUTBOX, PolledTable
from outbox_kit.persistence.unit_of_work import RelayWriter, SqlUnitOfWorkFactory, WakeSignal, notify_channel
from outbox_kit.processor.cycle import TableSource
from outbox_kit.processor.deliverers import CommandDeliverer, OutboxDeliverer
from outbox_kit.processor.in_process import LocalDispatcher
from outbox_kit.processor.processor import Deliverer, PostgresListener, SourceSettings
from outbox_kit.transports.bus import DirectPublisher, MessageBus

from ..settings import Settings


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


def build_dispatcher(  # noqa: PLR0917 (the container passes providers positionally)
    settings: Settings,
    handlers: HandlerRegistry,
    registry: MessageRegistry,
    metrics: RelayMetrics,
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
        notify_channel=notify_channel(settings.application.resolved_namespace),
        shutdown_timeout_seconds=outbox.shutdown_timeout_seconds,
        publish_direct=DirectPublisher(bus, registry),
        metrics=metrics,
    )


def source_settings(settings: Settings) -> SourceSettings:
    return SourceSettings.of(settings.outbox, single_writer=not settings.database.is_postgresql)


def build_sources(  # noqa: PLR0917 (the container passes providers positionally)
    settings: Settings,
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


def retention_policy(settings: Settings) -> RetentionPolicy:
    return RetentionPolicy.of(
        settings.outbox, settings.inbox, idempotency_key_hours=settings.api.idempotency_key_retention_hours
    )


def build_listener(settings: Settings, wake: WakeSignal) -> PostgresListener | None:
    if not settings.database.is_postgresql:
        return None
    dsn = settings.database.url.replace("postgresql+asyncpg://", "postgresql://", 1)
    return PostgresListener(dsn, notify_channel(settings.application.resolved_namespace), wake)
