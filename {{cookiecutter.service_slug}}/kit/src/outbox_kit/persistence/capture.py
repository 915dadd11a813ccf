"""What a commit writes to the relay tables: the staged and written rows, and the writer.

The rows one commit writes: staged before the INSERT (with the live message, for in-process
dispatch) and written (with the seq the database gave them).

What wakes a processor early: the in-process signal and PostgreSQL NOTIFY.

Committing transactions on PostgreSQL send one ``NOTIFY`` (delivered only on commit); every
replica ``LISTEN``s on a dedicated asyncpg connection, never inside a transaction (a listener in
an open transaction receives nothing until it ends). Notifications sent while the listener was
disconnected are lost, so each (re)connect triggers one catch-up wake, and the fallback interval
remains the safety net: NOTIFY is a hint, never the only path.

Turn the messages a unit of work captured into rows of the same transaction.

Each row stores the message's stable name (never the Python qualname), its JSON payload, when it
occurred, when it becomes eligible for the processor, its ordering key and the captured request
context. Local domain-event rows that this process will dispatch right after commit are inserted
*already leased* (fresh lock token, ``locked_until = now + lease``): no processor replica can
claim them while the in-process dispatch runs, so the lease, not the processing delay, bounds
duplicate delivery. Integration-event rows are never leased at insert: the processor publishes
them at once.

Ordering keys are stored per kind (``domain:<key>``, ``integration:<key>``): domain events of an
aggregate stay in order among themselves, and so do its integration events, but a local handler
never waits for a broker publish of the same aggregate (during a broker outage it would wait for
the whole outage). The message itself keeps its plain key (Kafka's partition key).

On PostgreSQL two more things happen inside the transaction: a per-key advisory lock before a
keyed row is inserted (so ``seq`` order equals commit order within a key), and one ``NOTIFY``
(delivered only if the transaction commits) that wakes every replica's processor."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlmodel.ext.asyncio.session import AsyncSession

from outbox_kit.application.context import CapturedContext
from outbox_kit.application.handlers import HandlerRegistry
from outbox_kit.application.messages import IntegrationEvent, InternalCommand, MessageRegistry
from outbox_kit.domain.events import DomainEvent, Message
from outbox_kit.persistence.tables import COMMAND_TABLE, DOMAIN, INTEGRATION, OUTBOX_TABLE


@dataclass(frozen=True)
class StagedRow:
    """A row about to be inserted, with the live message for in-process dispatch."""

    table: sa.Table
    values: dict[str, Any]
    message: Message
    leased: bool

    @property
    def id(self) -> uuid.UUID:
        return uuid.UUID(str(self.values["id"]))

    @property
    def ordering_key(self) -> str | None:
        value = self.values.get("ordering_key")
        return None if value is None else str(value)


@dataclass
class WrittenRow:
    """A row that committed, as the in-process dispatcher needs it."""

    id: uuid.UUID
    seq: int
    ordering_key: str | None
    lock_token: uuid.UUID
    message: Message


@dataclass
class Capture:
    """Everything one commit writes."""

    rows: list[StagedRow] = field(default_factory=list)
    lock_token: uuid.UUID = field(default_factory=uuid.uuid4)

    @property
    def needs_wake(self) -> bool:
        """True when some row is for the processor (not leased to this process)."""
        return any(not row.leased for row in self.rows)


log = logging.getLogger(__name__)


def wake_replicas(channel: str) -> sa.Select[Any]:
    """``SELECT pg_notify(channel, '')``: run inside a transaction, PostgreSQL delivers it to
    every listening replica only if that transaction commits (so a wake never outruns its data)."""
    return sa.select(sa.func.pg_notify(channel, ""))


class WakeSignal:
    """A set of events, one per polling loop; ``set()`` wakes all of them."""

    def __init__(self) -> None:
        self._events: list[asyncio.Event] = []
        self.count = 0

    def subscribe(self) -> asyncio.Event:
        event = asyncio.Event()
        self._events.append(event)
        return event

    def set(self) -> None:
        self.count += 1
        for event in self._events:
            event.set()


def stored_ordering_key(kind: str, message: Message) -> str | None:
    """The key an outbox row is ordered by: the message's key within its kind's key space."""
    key = message.ordering_key()
    return None if key is None else f"{kind}:{key}"


def notify_channel(namespace: str) -> str:
    """The LISTEN/NOTIFY channel shared by every replica of one service."""
    return f"outbox_wake:{namespace}"


class RelayWriter:
    """Builds and inserts outbox and internal-command rows (no commit: the caller commits)."""

    def __init__(
        self,
        *,
        registry: MessageRegistry,
        handlers: HandlerRegistry,
        processing_delay: timedelta,
        lease: timedelta,
        immediate_dispatch: bool,
        instance_id: str,
        namespace: str,
        dialect: str,
    ) -> None:
        self._registry = registry
        self._handlers = handlers
        self._delay = processing_delay
        self._lease = lease
        self._immediate = immediate_dispatch
        self._instance_id = instance_id
        self._channel = notify_channel(namespace)
        self._dialect = dialect

    def _base(self, message: Message, context: CapturedContext, now: datetime) -> dict[str, Any]:
        return {
            "id": uuid.uuid4(),
            "payload": self._registry.dump(message),
            "ordering_key": message.ordering_key(),
            "tenant_id": context.tenant_id,
            "user_id": context.user_id,
            "user_roles": context.user_roles,
            "correlation_id": context.correlation_id,
            "trace_context": context.traceparent,
            "retry_count": 0,
            "occurred_on": getattr(message, "occurred_on", now),
        }

    def stage(
        self,
        *,
        events: Sequence[DomainEvent],
        integration_events: Sequence[IntegrationEvent],
        commands: Sequence[tuple[InternalCommand, datetime | None]],
        context: CapturedContext,
        now: datetime,
    ) -> Capture:
        capture = Capture()
        for event in events:
            leased = self._immediate and self._handlers.has_domain_handlers(type(event))
            values = self._base(event, context, now) | {
                "event_name": event.message_name,
                "kind": DOMAIN,
                "ordering_key": stored_ordering_key(DOMAIN, event),
                # The delay gives the in-process dispatch its chance; a row nobody here will
                # dispatch in-process is the processor's from the start.
                "available_on": now + self._delay if leased else now,
            }
            if leased:
                values |= {
                    "locked_until": now + self._lease,
                    "lock_token": capture.lock_token,
                    "locked_by": self._instance_id,
                }
            capture.rows.append(StagedRow(OUTBOX_TABLE, values, event, leased=leased))
        for integration_event in integration_events:
            values = self._base(integration_event, context, now) | {
                "event_name": integration_event.message_name,
                "kind": INTEGRATION,
                "ordering_key": stored_ordering_key(INTEGRATION, integration_event),
                "available_on": now,
            }
            capture.rows.append(StagedRow(OUTBOX_TABLE, values, integration_event, leased=False))
        for command, due_at in commands:
            values = self._base(command, context, now) | {
                "command_name": command.message_name,
                "occurred_on": now,
                "available_on": max(due_at, now) if due_at else now,
            }
            capture.rows.append(StagedRow(COMMAND_TABLE, values, command, leased=False))
        return capture

    async def write(self, session: AsyncSession, capture: Capture) -> list[WrittenRow]:
        """Insert the staged rows; return the leased ones for in-process dispatch."""
        if not capture.rows:
            return []
        dialect = self._dialect
        if dialect == "postgresql":
            keys = sorted({row.ordering_key for row in capture.rows if row.ordering_key})
            for key in keys:
                lock = sa.select(sa.func.pg_advisory_xact_lock(sa.func.hashtextextended(key, 0)))
                await session.exec(lock)  # type: ignore[call-overload]
        written: list[WrittenRow] = []
        for row in capture.rows:
            statement = sa.insert(row.table).values(**row.values)
            if dialect != "postgresql":
                # SQLite has no identity columns; its single writer makes max+1 safe.
                next_seq = sa.select(sa.func.coalesce(sa.func.max(row.table.c.seq), 0) + 1)
                statement = statement.values(seq=next_seq.scalar_subquery())
            result = await session.exec(statement.returning(row.table.c.seq))
            seq = int(result.scalar_one())
            if row.leased:
                written.append(WrittenRow(row.id, seq, row.ordering_key, capture.lock_token, row.message))
        if dialect == "postgresql" and capture.needs_wake:
            await session.exec(wake_replicas(self._channel))  # type: ignore[call-overload]
        return written
