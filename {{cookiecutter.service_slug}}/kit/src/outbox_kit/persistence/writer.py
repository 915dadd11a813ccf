"""The writer: the messages a unit of work captured, as rows of its own transaction, and the wake
that tells the processors.

**The rows a commit writes** to the relay tables are staged before the INSERT (with the live
message, for in-process dispatch) and then written (with the seq the database gave them).

**What wakes a processor early**: the in-process signal and PostgreSQL NOTIFY. Committing
transactions on PostgreSQL send one ``NOTIFY`` (delivered only on commit); every
replica ``LISTEN``s on a dedicated asyncpg connection, never inside a transaction (a listener in
an open transaction receives nothing until it ends). Notifications sent while the listener was
disconnected are lost, so each (re)connect triggers one catch-up wake, and the fallback interval
remains the safety net: NOTIFY is a hint, never the only path.

**The writer** turns the messages a unit of work captured into rows of the same transaction.
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

On PostgreSQL a commit's rows of one table are one statement (:class:`BatchInsert`), which also
takes a per-key advisory lock before any row gets its ``seq`` (so ``seq`` order equals commit
order within a key) and sends one ``NOTIFY`` (delivered only if the transaction commits) that
wakes every replica's processor; a single keyless row needs no lock and is a plain INSERT
carrying the NOTIFY.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlmodel.ext.asyncio.session import AsyncSession

from outbox_kit.application.context import CapturedContext
from outbox_kit.application.handlers import HandlerRegistry
from outbox_kit.application.messages import IntegrationEvent, InternalCommand, MessageRegistry
from outbox_kit.domain import DomainEvent, Message
from outbox_kit.persistence.tables import (
    COMMAND_TABLE,
    DOMAIN,
    INTEGRATION,
    OUTBOX_TABLE,
)


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


@dataclass(frozen=True)
class Lease:
    """Where the rows a commit leases to this process (for in-process dispatch) are leased: one
    token and one end for all of them. Units of work that commit in one transaction (a consumed
    batch) share one, so the commit that gives them back on a cancellation finds them all."""

    token: uuid.UUID
    until: datetime


@dataclass
class Capture:
    """Everything one commit writes."""

    rows: list[StagedRow] = field(default_factory=list)
    lock_token: uuid.UUID = field(default_factory=uuid.uuid4)

    @property
    def needs_wake(self) -> bool:
        """True when some row is for the processor (not leased to this process)."""
        return any(not row.leased for row in self.rows)

    @property
    def lease_until(self) -> datetime | None:
        """Where the rows leased to this process are leased until (one value for all of them);
        None when there are none."""
        return next((row.values["locked_until"] for row in self.rows if row.leased), None)


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
        self._row_inserts: dict[tuple[str, frozenset[str], bool], sa.Executable] = {}
        self._batch_inserts: dict[tuple[str, frozenset[str], bool], BatchInsert] = {}

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
        lease: Lease | None = None,
    ) -> Capture:
        lease = lease or self.new_lease(now)
        capture = Capture(lock_token=lease.token)
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
                    "locked_until": lease.until,
                    "lock_token": lease.token,
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

    def new_lease(self, now: datetime) -> Lease:
        """A fresh lease from ``now`` for the rows of one commit."""
        return Lease(uuid.uuid4(), now + self._lease)

    async def write(self, session: AsyncSession, capture: Capture) -> list[WrittenRow]:
        """Insert the staged rows; return the leased ones for in-process dispatch. On PostgreSQL
        a commit of several rows, or of a keyed one, is one statement per table
        (:class:`BatchInsert`); a single keyless row, the most common commit, is its own
        prebuilt INSERT (through SQLAlchemy, ``unnest`` of one row cost it about 10% more CPU).
        SQLite writes each row on its own."""
        if not capture.rows:
            return []
        postgresql = self._dialect == "postgresql"
        if postgresql and (len(capture.rows) > 1 or capture.rows[0].ordering_key):
            return await self._write_together(session, capture)
        written: list[WrittenRow] = []
        for row in capture.rows:
            wake = postgresql and capture.needs_wake  # one row on PostgreSQL
            result = await session.exec(self._insert(row, wake=wake), params=row.values)  # type: ignore[call-overload]
            seq = int(result.one()[0])
            if row.leased:
                written.append(WrittenRow(row.id, seq, row.ordering_key, capture.lock_token, row.message))
        return written

    async def _write_together(self, session: AsyncSession, capture: Capture) -> list[WrittenRow]:
        """PostgreSQL: one statement per table for all of a commit's rows (see
        :class:`BatchInsert`)."""
        tables: dict[str, list[StagedRow]] = {}
        for row in capture.rows:
            tables.setdefault(row.table.name, []).append(row)
        keys = sorted({row.ordering_key for row in capture.rows if row.ordering_key})
        seqs: dict[uuid.UUID, int] = {}
        for number, rows in enumerate(tables.values(), start=1):
            wake = number == len(tables) and capture.needs_wake
            columns = sorted(set().union(*(row.values for row in rows)))  # a leased row has more
            insert = await self._batch_insert(session, rows[0].table, columns, wake=wake)
            params = insert.values(rows, keys if number == 1 else [])
            result = await session.exec(insert.statement, params=params)  # type: ignore[call-overload]
            seqs.update((uuid.UUID(str(row[0])), int(row[1])) for row in result)
        return [
            WrittenRow(row.id, seqs[row.id], row.ordering_key, capture.lock_token, row.message)
            for row in capture.rows
            if row.leased
        ]

    async def _batch_insert(
        self, session: AsyncSession, table: sa.Table, columns: list[str], *, wake: bool
    ) -> BatchInsert:
        key = (table.name, frozenset(columns), wake)
        insert = self._batch_inserts.get(key)
        if insert is None:
            dialect = (await session.connection()).dialect  # the driver's: its bind processing
            channel = self._channel if wake else None
            insert = self._batch_inserts[key] = BatchInsert(table, columns, channel, dialect)
        return insert

    def _insert(self, row: StagedRow, *, wake: bool) -> sa.Executable:
        """The INSERT ... RETURNING seq for rows with ``row``'s columns, built once and then
        bound to each row's values (building a statement per row cost more CPU than running it).
        With ``wake``, the insert and the replicas' wake are one round trip: ``WITH inserted AS
        (INSERT ...) SELECT seq, pg_notify(...) FROM inserted``, the same ``pg_notify`` as
        :func:`wake_replicas` (delivered only if the transaction commits)."""
        key = (row.table.name, frozenset(row.values), wake)
        statement = self._row_inserts.get(key)
        if statement is None:
            statement = self._row_inserts[key] = self._build_insert(row.table, sorted(row.values), wake=wake)
        return statement

    def _build_insert(self, table: sa.Table, columns: list[str], *, wake: bool) -> sa.Executable:
        insert = sa.insert(table).values(
            {name: sa.bindparam(name, type_=table.c[name].type) for name in columns}
        )
        if self._dialect != "postgresql":
            # SQLite has no identity columns; its single writer makes max+1 safe.
            next_seq = sa.select(sa.func.coalesce(sa.func.max(table.c.seq), 0) + 1)
            insert = insert.values(seq=next_seq.scalar_subquery())
        returning = insert.returning(table.c.seq)
        if not wake:
            return returning
        rows = returning.cte("inserted")
        return sa.select(rows.c.seq, sa.func.pg_notify(self._channel, ""))


class BatchInsert:
    """The rows one commit writes to one table as one PostgreSQL statement, built once per
    table, column set and wake, then bound to each commit's rows as arrays (``unnest``).

    In that one statement, in this order: the advisory locks of the commit's ordering keys (one
    per key, in key order, so two writers never wait on each other in a circle), taken before
    any row gets its ``seq``, so ``seq`` order equals commit order within a key; the rows, in
    the order they were staged; and, with ``wake``, the replicas' wake (the same ``pg_notify``
    as :func:`wake_replicas`, delivered only if the transaction commits). A statement per row
    and one per key cost each commit a round trip apiece.

    The values go through each column's SQLAlchemy bind processing (a JSON payload becomes its
    text, a datetime must be aware), so the rows are exactly what an ORM insert stored. Each
    array is cast to the column's base type (``text``, not ``varchar(200)``, which would cut a
    long value short): the assignment to the column refuses a value too long for it.

    It runs through the session like any statement (its errors are SQLAlchemy's, so a deadlock
    is a transient error ``run`` retries, and traced statements include it). On the session's
    asyncpg connection directly it cost about 10% less CPU per commit, which was not worth
    bypassing that."""

    def __init__(
        self, table: sa.Table, columns: list[str], wake_channel: str | None, dialect: sa.Dialect
    ) -> None:
        types = {name: table.c[name].type for name in columns}
        self._processors = {name: kind.bind_processor(dialect) for name, kind in types.items()}
        self.wake_channel = wake_channel
        self.statement = sa.text(self._sql(table, types))

    def _sql(self, table: sa.Table, types: dict[str, sa.types.TypeEngine[Any]]) -> str:
        names = ", ".join(types)
        arrays = ", ".join(f"CAST(:{name} AS {_array_type(kind)}[])" for name, kind in types.items())
        wake = ", (SELECT pg_notify(CAST(:wake_channel AS text), ''))" if self.wake_channel else ""
        return (
            f"WITH locked AS (SELECT pg_advisory_xact_lock(hashtextextended(key, 0))"  # noqa: S608 (names from the table)
            " FROM unnest(CAST(:ordering_keys AS text[])) AS key),"
            f" inserted AS (INSERT INTO {table.name} ({names})"
            f" SELECT {names} FROM unnest({arrays}) WITH ORDINALITY AS staged ({names}, position)"
            f" WHERE (SELECT count(*) FROM locked) >= 0 ORDER BY position RETURNING id, seq)"
            f" SELECT id, seq{wake} FROM inserted"
        )

    def values(self, rows: Sequence[StagedRow], keys: list[str]) -> dict[str, Any]:
        """The statement's parameters for ``rows``, and the keys to lock."""
        values: dict[str, Any] = {}
        for name, process in self._processors.items():
            column = [row.values.get(name) for row in rows]
            values[name] = column if process is None else [None if v is None else process(v) for v in column]
        values["ordering_keys"] = keys
        if self.wake_channel is not None:
            values["wake_channel"] = self.wake_channel
        return values


POSTGRESQL: sa.Dialect = postgresql.dialect()  # type: ignore[no-untyped-call]


def _array_type(kind: sa.types.TypeEngine[Any]) -> str:
    """The PostgreSQL type of an array of ``kind``'s values: its own, but ``text`` for strings."""
    name = str(kind.compile(dialect=POSTGRESQL)).split("(", 1)[0]
    return "text" if name in {"VARCHAR", "TEXT"} else name
