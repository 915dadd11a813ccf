"""The SQL unit of work (one transaction, and the only place that saves) and its factory.

``commit()`` does, in this order:

1. snapshots the pending events of every aggregate its repositories have seen, plus the
   integration events and internal commands enqueued on it;
2. persists the aggregates (a stale version raises ``ConcurrencyError``) and writes one outbox
   row per event in the same transaction, with the request context captured on each row;
3. applies what a unit of work that delivers a message writes besides the handler's effects: the
   token-guarded processed stamp of the row it delivers (if another processor took the row, the
   stamp matches nothing and ``LeaseLostError`` rolls everything back, so a redelivery cannot
   double an effect);
4. commits, then removes exactly the captured events from the aggregates (events a handler
   raises meanwhile stay pending for the next save) and wakes the processor;
5. hands the local domain-event rows it leased to the in-process delivery (:class:`AfterCommit`),
   or, in a follow-up of that delivery, leaves them to it (``left``).

A rollback, whether an exception or an explicit ``rollback()``, drops the rows together with the
business change and every deferred piece of work. ``run(operation)`` re-runs a whole operation
on a transient database error, each attempt on a fresh session, and writes exactly one row per
event because nothing is captured until a commit succeeds.

Why handlers do not save: a handler runs *after* the commit that raised its event, inside the
follow-up unit of work that also stamps the event processed. If it committed on its own, its
writes would land without the stamp (a retry would repeat them) or before the owning transaction
decided (a rollback could not undo them). While a handler runs, ``commit()`` therefore raises
:class:`HandlerMustNotSaveError` naming it; the architecture tests prove the same statically.

:class:`SqlUnitOfWorkFactory` (built once by the container) creates units of work and holds what
they share; it is the contexts' ``UnitOfWorkFactory`` for entry points. In-process delivery (the
processor's, a package above) comes in as :class:`AfterCommit`: the one port here, because the
delivery opens units of work of its own from this factory.

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
carrying the NOTIFY."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any, Generic, Protocol, Self, TypeVar

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.exc import DBAPIError
from sqlmodel.ext.asyncio.session import AsyncSession

from outbox_kit.application.clock import Clock
from outbox_kit.application.context import CapturedContext, capture_context
from outbox_kit.application.handlers import HandlerRegistry
from outbox_kit.application.messages import IntegrationEvent, InternalCommand, MessageRegistry
from outbox_kit.application.unit_of_work import Adapter
from outbox_kit.domain import AggregateRoot, DomainEvent, Message
from outbox_kit.persistence import repository as savepoints
from outbox_kit.persistence.database import Database, is_transient
from outbox_kit.persistence.repository import Repository
from outbox_kit.persistence.save_guard import refuse_commit_in_handler
from outbox_kit.persistence.tables import (
    COMMAND_TABLE,
    DOMAIN,
    INTEGRATION,
    OUTBOX_TABLE,
    LeaseLostError,
    LeaseStore,
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


@dataclass(frozen=True)
class Stamp:
    store: LeaseStore
    row_id: uuid.UUID
    token: uuid.UUID


@dataclass
class DeliveryRecords:
    """The processed stamps one unit of work writes at commit."""

    stamps: list[Stamp] = field(default_factory=list)

    def stamp(self, store: LeaseStore, row_id: uuid.UUID, token: uuid.UUID) -> None:
        self.stamps.append(Stamp(store, row_id, token))

    async def apply(self, session: AsyncSession, now: datetime) -> None:
        for stamp in self.stamps:
            connection = await session.connection()
            if not await stamp.store.stamp_processed(connection, [stamp.row_id], stamp.token, now):
                msg = f"lease on {stamp.store.table.name} row {stamp.row_id} was lost"
                raise LeaseLostError(msg)


@dataclass(frozen=True)
class Committed:
    """What a commit leaves to in-process delivery: the domain-event rows it inserted leased to
    this process; with the outbox off, the events themselves (delivered and published directly,
    best effort)."""

    rows: Sequence[WrittenRow] = ()
    events: Sequence[DomainEvent] = ()
    integration_events: Sequence[IntegrationEvent] = ()


class AfterCommit(Protocol):
    """Delivers, in-process, what a commit wrote for this process."""

    async def commit_leased(self, commit: Awaitable[None], token: uuid.UUID, lease_until: datetime) -> None:
        """Run ``commit``, which inserts rows leased to this process under ``token`` until
        ``lease_until``; if a cancellation interrupts it (the COMMIT may have landed, its answer
        on the way), give back every such row before the cancellation goes on (bounded by the
        shutdown timeout), so the processor retries them after the processing delay, not the
        lease."""
        ...

    async def dispatch(self, committed: Committed, units: SqlUnitOfWorkFactory) -> None:
        """Deliver what a commit of ``units`` left to this process, each in a follow-up unit of
        work of ``units`` (never raises but on shutdown: the commit stands)."""
        ...


T = TypeVar("T")
P = TypeVar("P")


class UnitOfWorkStateError(RuntimeError):
    """The unit of work was used outside ``async with`` or after it finished."""


@dataclass(frozen=True)
class _Captured:
    """The aggregates' pending events as the commit saw them (removed only after it)."""

    aggregates: list[tuple[AggregateRoot, Repository[Any], tuple[DomainEvent, ...]]]

    @property
    def events(self) -> list[DomainEvent]:
        return [event for _, _, pending in self.aggregates for event in pending]


@dataclass(frozen=True)
class Staged:
    """What a unit of work wrote into its transaction, for the steps after the commit."""

    captured: _Captured
    new_versions: list[tuple[AggregateRoot, int]]
    outbox: Capture
    written: list[WrittenRow]


@dataclass(frozen=True)
class SharedTransaction:
    """One session that several units of work write into and that commits once for all of them
    (a consumed batch: ``consume.inbox``), with the one lease their in-process rows share."""

    session: AsyncSession
    lease: Lease


async def run_before_commit(
    writes: list[Callable[[], Awaitable[None]]], new_versions: list[tuple[AggregateRoot, int]]
) -> None:
    """The ``before_commit`` writes, with the versions the commit saves on the aggregates
    meanwhile; the versions go back until the commit succeeds (a failed commit changed nothing).
    Shared with the in-memory unit of work (``outbox_kit.testing``)."""
    if not writes:
        return
    saved = [(aggregate, aggregate.version) for aggregate, _ in new_versions]
    for aggregate, version in new_versions:
        aggregate.version = version
    try:
        for write in writes:
            await write()
    finally:
        for aggregate, version in saved:
            aggregate.version = version


R = TypeVar("R")


class CollectingUnitOfWork(Generic[R]):
    """What a unit of work collects until its commit, and the methods that collect it: the
    aggregates its repositories (``R``) track, the repositories bound to it, integration events,
    internal commands and ``before_commit`` writes. The SQL unit of work and the in-memory fake
    (``outbox_kit.testing``) share it, so the two cannot collect differently."""

    def _reset_collected(self) -> None:
        self._tracked: list[tuple[AggregateRoot, R]] = []
        self._repositories: dict[type[Any], Any] = {}
        self._integration_events: list[IntegrationEvent] = []
        self._commands: list[tuple[InternalCommand, datetime | None]] = []
        self._before_commit: list[Callable[[], Awaitable[None]]] = []

    def track(self, aggregate: AggregateRoot, repository: R) -> None:
        """Remember an aggregate so its events are captured at commit (repositories call it)."""
        if not any(seen is aggregate for seen, _ in self._tracked):
            self._tracked.append((aggregate, repository))

    def enqueue(self, event: IntegrationEvent) -> None:
        """Publish ``event`` to other services once this transaction commits (via the outbox)."""
        self._integration_events.append(event)

    def schedule(self, command: InternalCommand, due_at: datetime | None = None) -> None:
        """Run ``command`` later, in its own unit of work, once this transaction commits."""
        self._commands.append((command, due_at))

    def before_commit(self, write: Callable[[], Awaitable[None]]) -> None:
        """Run ``write`` in this transaction at commit, once the aggregates are saved: while it
        runs they carry their saved versions, so it can record what the caller will be answered
        (an idempotency key's answer) in the same transaction."""
        self._before_commit.append(write)


class SqlUnitOfWork(CollectingUnitOfWork["Repository[Any]"]):
    """One business transaction on one session. ``async with uow:`` then ``await uow.commit()``.

    Implements the contexts' ``UnitOfWork`` and ``AdapterScope`` Protocols, and what only the
    delivery machinery uses: the session and processed stamps.
    """

    def __init__(
        self,
        factory: SqlUnitOfWorkFactory,
        *,
        shared: SharedTransaction | None = None,
        follow_up: bool = False,
    ) -> None:
        self._factory = factory
        self._shared = shared
        self._follow_up = follow_up
        self._session: AsyncSession | None = None
        self._reset()

    def _reset(self) -> None:
        self._reset_collected()
        self._records = DeliveryRecords()
        self.committed = False
        # A follow-up's commit: what it leased, left to the dispatch that opened it.
        self.left: Committed | None = None

    # -- lifecycle -------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        if self._session is not None:
            msg = "this unit of work is already open"
            raise UnitOfWorkStateError(msg)
        self._reset()
        self._session = self._factory.database.sessions() if self._shared is None else self._shared.session
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        session, self._session = self._session, None
        if session is None or self._shared is not None:  # a shared session is its owner's to end
            return
        try:
            if not self.committed:
                await session.rollback()
        finally:
            await session.close()

    @property
    def session(self) -> AsyncSession:
        if self._session is None:
            msg = "open the unit of work with 'async with uow:' before using it"
            raise UnitOfWorkStateError(msg)
        return self._session

    @property
    def now(self) -> datetime:
        return self._factory.clock()

    async def run(self, operation: Callable[[Self], Awaitable[T]]) -> T:
        """Run ``operation`` and commit, re-running all of it on a transient database error."""
        attempts = self._factory.transient_retry_attempts
        for attempt in range(1, attempts + 1):
            try:
                async with self:
                    result = await operation(self)
                    if not self.committed:
                        await self.commit()
                    return result
            except DBAPIError as error:
                if attempt == attempts or not is_transient(error):
                    raise
                await self._factory.transient_pause(attempt, error)
        msg = "unreachable"
        raise AssertionError(msg)

    # -- what a transaction collects -------------------------------------------------------

    def repository(self, port: type[P]) -> P:
        """The adapter of ``port`` bound to this unit of work (one instance per port).

        ``port`` is usually a Protocol a bounded context declares; the composition root maps it
        to its adapter, so use cases never import an adapter.
        """
        repository = self._repositories.get(port)
        if repository is None:
            self._factory.refuse_foreign(port)
            adapter = self._factory.adapters.get(port, port)
            repository = adapter(self)
            self._repositories[port] = repository
        return repository  # type: ignore[no-any-return]

    def stamp_processed_on_commit(self, store: LeaseStore, row_id: uuid.UUID, token: uuid.UUID) -> None:
        """Mark a delivered row processed in this transaction (dispatcher and processors)."""
        self._records.stamp(store, row_id, token)

    @asynccontextmanager
    async def savepoint(self) -> AsyncIterator[None]:
        """A nested transaction; releasing it commits nothing and dispatches nothing. When the
        block raises, this unit of work rolls back with the database (see ``savepoint``), so a
        later ``commit()`` saves exactly what was decided outside the failed block."""
        snapshot = savepoints.take(self._tracked, self._collected())
        try:
            async with self.session.begin_nested():
                yield
        except BaseException:
            self._tracked = savepoints.restore(snapshot, self._collected())
            raise

    def _collected(self) -> dict[str, list[Any]]:
        return {
            "integration_events": self._integration_events,
            "commands": self._commands,
            "stamps": self._records.stamps,
        }

    # -- the save --------------------------------------------------------------------------

    async def rollback(self) -> None:
        """Abandon everything: business change, outbox rows and deferred work alike."""
        await self.session.rollback()
        self._reset()

    async def commit(self) -> None:
        refuse_commit_in_handler()  # first: a handler's commit is named as that
        if self._shared is not None:
            msg = "this unit of work shares its transaction: its owner writes it (stage) and commits it"
            raise UnitOfWorkStateError(msg)
        staged = await self.stage()
        await self._commit_session(staged.outbox)
        await self.committed_as(staged)

    async def stage(self) -> Staged:
        """Steps 1-3 of ``commit()``: everything it writes, written into the transaction, not
        committed. The owner of a shared transaction commits it, then calls :meth:`committed_as`."""
        refuse_commit_in_handler()
        if self.committed:
            msg = "this unit of work has already committed; open a new one"
            raise UnitOfWorkStateError(msg)
        captured = _Captured([(agg, repo, agg.pending_events) for agg, repo in self._tracked])
        new_versions = await self._persist_aggregates(captured)
        await self._run_before_commit(new_versions)
        outbox, written = await self._write_rows(captured)
        await self._records.apply(self.session, self.now)
        return Staged(captured, new_versions, outbox, written)

    async def committed_as(self, staged: Staged) -> None:
        """Steps 4-5 of ``commit()``, once the transaction that holds ``staged`` committed."""
        self.committed = True
        captured = staged.captured
        for aggregate, _, aggregate_events in captured.aggregates:
            aggregate.remove_events(aggregate_events)
        for aggregate, version in staged.new_versions:
            aggregate.version = version
        await self._after_commit(captured, staged.outbox, staged.written)

    async def _persist_aggregates(self, captured: _Captured) -> list[tuple[AggregateRoot, int]]:
        return [
            (aggregate, await repository.persist(aggregate))
            for aggregate, repository, pending in captured.aggregates
            if pending
        ]

    async def _run_before_commit(self, new_versions: list[tuple[AggregateRoot, int]]) -> None:
        await run_before_commit(self._before_commit, new_versions)

    async def _commit_session(self, outbox: Capture) -> None:
        """COMMIT; rows it leases to this process are given back if a cancellation interrupts it
        (a cancellation after it lands in the dispatch, which gives them back as well)."""
        until = outbox.lease_until
        if until is None:
            await self.session.commit()
            return
        await self._factory.after_commit.commit_leased(self.session.commit(), outbox.lock_token, until)

    async def _write_rows(self, captured: _Captured) -> tuple[Capture, list[WrittenRow]]:
        """One outbox row per event and one row per command, in this transaction."""
        enabled = self._factory.outbox_enabled
        outbox = self._factory.writer.stage(
            events=captured.events if enabled else [],
            integration_events=self._integration_events if enabled else [],
            commands=self._commands,
            context=capture_context(),
            now=self.now,
            lease=None if self._shared is None else self._shared.lease,
        )
        return outbox, await self._factory.writer.write(self.session, outbox)

    async def _after_commit(self, captured: _Captured, outbox: Capture, written: list[WrittenRow]) -> None:
        if self._factory.outbox_enabled:
            committed = Committed(rows=written)
        else:
            committed = Committed(events=captured.events, integration_events=list(self._integration_events))
        self._integration_events.clear()
        self._commands.clear()
        if outbox.needs_wake:
            self._factory.wake()
        if self._follow_up:
            self.left = committed
        else:
            await self._factory.after_commit.dispatch(committed, self._factory)


class CrossSourceError(RuntimeError):
    """A unit of work asked for a port whose context keeps its data in another source."""

    def __init__(self, port: type[Any], here: str, there: str) -> None:
        super().__init__(
            f"{port.__qualname__} belongs to source {there!r}, but this unit of work writes to source "
            f"{here!r}: one transaction cannot span two sources. Enqueue an integration event "
            f"(uow.enqueue) and let a handler of the context in {there!r} make the change there."
        )
        self.here, self.there = here, there


class SqlUnitOfWorkFactory:
    """``factory()`` gives a new, unopened unit of work on one source's database.

    ``foreign_ports`` names the source of every port whose context lives in another source: a
    unit of work of this factory refuses them (:class:`CrossSourceError`)."""

    def __init__(
        self,
        *,
        database: Database,
        writer: RelayWriter,
        after_commit: AfterCommit,
        clock: Clock,
        wake: Callable[[], None],
        outbox_enabled: bool,
        adapters: Mapping[type[Any], Adapter] | None = None,
        source: str = "default",
        foreign_ports: Mapping[type[Any], str] | None = None,
    ) -> None:
        self.source = source
        self.foreign_ports: Mapping[type[Any], str] = dict(foreign_ports or {})
        self.database = database
        self.writer = writer
        self.after_commit = after_commit
        self.clock = clock
        self.wake = wake
        self.outbox_enabled = outbox_enabled
        self.adapters: Mapping[type[Any], Adapter] = dict(adapters or {})
        self.transient_retry_attempts = database.settings.transient_retry_attempts

    def __call__(self, *, shared: SharedTransaction | None = None) -> SqlUnitOfWork:
        return SqlUnitOfWork(self, shared=shared)

    def follow_up(self) -> SqlUnitOfWork:
        """A unit of work of in-process delivery: its commit leaves what it leased in ``left``
        for the delivery that opened it, instead of dispatching it."""
        return SqlUnitOfWork(self, follow_up=True)

    def refuse_foreign(self, port: type[Any]) -> None:
        there = self.foreign_ports.get(port)
        if there is not None:
            raise CrossSourceError(port, self.source, there)

    async def transient_pause(self, attempt: int, error: DBAPIError) -> None:
        log.warning(
            "transient database error, re-running the operation (attempt %s/%s): %s",
            attempt,
            self.transient_retry_attempts,
            error.orig,
        )
        await asyncio.sleep(0.05 * 2 ** (attempt - 1))
