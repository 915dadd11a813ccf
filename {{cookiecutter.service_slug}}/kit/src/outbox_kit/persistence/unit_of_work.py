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

What a commit writes to the relay tables, and how it wakes the processors, is the writer's
(``persistence.writer``)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime
from types import TracebackType
from typing import Any, Generic, Protocol, Self, TypeVar

from sqlalchemy.exc import DBAPIError
from sqlmodel.ext.asyncio.session import AsyncSession

from outbox_kit.application.clock import Clock
from outbox_kit.application.context import capture_context
from outbox_kit.application.messages import IntegrationEvent, InternalCommand
from outbox_kit.application.unit_of_work import Adapter
from outbox_kit.domain import AggregateRoot, DomainEvent
from outbox_kit.persistence import repository as savepoints
from outbox_kit.persistence.database import Database, is_transient
from outbox_kit.persistence.repository import Repository
from outbox_kit.persistence.save_guard import refuse_commit_in_handler
from outbox_kit.persistence.tables import (
    LeaseLostError,
    LeaseStore,
)
from outbox_kit.persistence.writer import Capture, Lease, RelayWriter, WrittenRow

log = logging.getLogger(__name__)


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
