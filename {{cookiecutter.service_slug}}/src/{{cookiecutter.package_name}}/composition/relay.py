"""The relay's parts: the row writer, the in-process dispatcher, the polled sources, retention
and the PostgreSQL listener."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from datetime import timedelta

from outbox_kit.application.handlers import HandlerRegistry
from outbox_kit.application.messages import MessageRegistry
from outbox_kit.application.observability import RelayMetrics, Tracing
from outbox_kit.application.timing import system_clock
from outbox_kit.operations.retention import RetentionPolicy
from outbox_kit.persistence.capture import RelayWriter, WakeSignal, notify_channel
from outbox_kit.persistence.database import Database
from outbox_kit.persistence.tables import INTERNAL_COMMANDS, OUTBOX, PolledTable
from outbox_kit.persistence.unit_of_work import SqlUnitOfWorkFactory
from outbox_kit.processor.commands import CommandDeliverer
from outbox_kit.processor.cycle import TableSource
from outbox_kit.processor.in_process import LocalDispatcher
from outbox_kit.processor.listener import PostgresListener
from outbox_kit.processor.outbox import OutboxDeliverer
from outbox_kit.processor.processor import Deliverer, SourceSettings
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
    o = settings.outbox
    # SQLite has one writer: concurrent deliveries would only queue on its lock.
    concurrency = o.delivery_concurrency if settings.database.is_postgresql else 1
    return SourceSettings(
        batch_size=o.batch_size,
        delivery_concurrency=concurrency,
        claim_window=o.effective_claim_window,
        lease_seconds=o.lease_seconds,
        delivery_timeout_seconds=o.delivery_timeout_seconds,
        renew_below_seconds=o.renew_below_seconds,
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
    return RetentionPolicy(
        retention_days=settings.outbox.retention_days,
        dead_letter_days=settings.outbox.dead_letter_window_days,
        inbox_retention_days=settings.inbox.retention_days,
        idempotency_key_hours=settings.api.idempotency_key_retention_hours,
        batch_size=settings.outbox.cleanup_batch_size,
    )


def build_listener(settings: Settings, wake: WakeSignal) -> PostgresListener | None:
    if not settings.database.is_postgresql:
        return None
    dsn = settings.database.url.replace("postgresql+asyncpg://", "postgresql://", 1)
    return PostgresListener(dsn, notify_channel(settings.application.resolved_namespace), wake)
