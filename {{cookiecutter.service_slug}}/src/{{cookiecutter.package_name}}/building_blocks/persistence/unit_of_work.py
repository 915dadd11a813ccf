"""The unit of work: one transaction, and the only place that saves.

``commit()`` does, in this order:

1. snapshots the pending events of every aggregate its repositories have seen, plus the
   integration events and internal commands enqueued on it;
2. persists the aggregates (a stale version raises ``ConcurrencyError``) and writes one outbox
   row per event in the same transaction, with the request context captured on each row;
3. applies the token-guarded stamps and the staged inbox row of the delivery it belongs to (if
   any): a lost lease rolls everything back, so a redelivery cannot double an effect;
4. commits, then removes exactly the captured events from the aggregates (events a handler
   raises meanwhile stay pending for the next save) and wakes the processor;
5. dispatches the local domain events it leased, in-process (see ``outbox.dispatch``).

A rollback, whether an exception or an explicit ``rollback()``, drops the rows together with the
business change and every deferred piece of work. ``run(operation)`` re-runs a whole operation
on a transient database error, each attempt on a fresh session, and writes exactly one row per
event because nothing is captured until a commit succeeds.

Why handlers do not save: a handler runs *after* the commit that raised its event, inside the
follow-up unit of work that also stamps the event processed. If it committed on its own, its
writes would land without the stamp (a retry would repeat them) or before the owning transaction
decided (a rollback could not undo them). While a handler runs, ``commit()`` therefore raises
:class:`HandlerMustNotSaveError` naming it; the architecture tests prove the same statically.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self, TypeVar

from sqlalchemy.exc import DBAPIError
from sqlmodel.ext.asyncio.session import AsyncSession

from ..context import capture
from ..domain.aggregate import AggregateRoot
from ..domain.events import DomainEvent
from ..messages import IntegrationEvent, InternalCommand
from ..polling.leases import LeaseLostError, LeaseStore
from .database import is_transient
from .guard import HandlerMustNotSaveError, handler_scope, refuse_commit_in_handler, running_handler
from .models import InboxMessage

if TYPE_CHECKING:
    from .repository import Repository
    from .unit_of_work_factory import UnitOfWorkFactory

__all__ = [  # the guard's names are re-exported: handlers and tests know them from here
    "HandlerMustNotSaveError",
    "UnitOfWork",
    "UnitOfWorkStateError",
    "handler_scope",
    "running_handler",
]
T = TypeVar("T")
P = TypeVar("P")


class UnitOfWorkStateError(RuntimeError):
    """The unit of work was used outside ``async with`` or after it finished."""


@dataclass(frozen=True)
class _Stamp:
    store: LeaseStore
    row_id: uuid.UUID
    token: uuid.UUID


@dataclass(frozen=True)
class _Snapshot:
    """What a savepoint restores when its block fails."""

    tracked: list[tuple[AggregateRoot, Repository[Any]]]
    states: list[dict[str, Any]]
    integration_events: int
    commands: int
    stamps: int
    inbox: int


def _aggregate_state(aggregate: AggregateRoot) -> dict[str, Any]:
    """A deep copy of the aggregate's attributes, sharing the pending event objects themselves
    (``remove_events`` matches them by identity after a commit)."""
    state = {key: value for key, value in vars(aggregate).items() if key != "_pending_events"}
    copied = copy.deepcopy(state)
    copied["_pending_events"] = list(aggregate.pending_events)
    return copied


class UnitOfWork:
    """One business transaction. Use ``async with uow:`` then ``await uow.commit()``."""

    def __init__(self, factory: UnitOfWorkFactory, *, depth: int = 0) -> None:
        self._factory = factory
        self.depth = depth
        self._session: AsyncSession | None = None
        self._reset()

    def _reset(self) -> None:
        self._tracked: list[tuple[AggregateRoot, Repository[Any]]] = []
        self._repositories: dict[type[Any], Any] = {}
        self._integration_events: list[IntegrationEvent] = []
        self._commands: list[tuple[InternalCommand, datetime | None]] = []
        self._stamps: list[_Stamp] = []
        self._inbox: list[InboxMessage] = []
        self.committed = False

    # -- lifecycle -------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        if self._session is not None:
            msg = "this unit of work is already open"
            raise UnitOfWorkStateError(msg)
        self._reset()
        self._session = self._factory.database.sessions()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        session, self._session = self._session, None
        if session is None:
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
            adapter = self._factory.adapters.get(port, port)
            repository = adapter(self)
            self._repositories[port] = repository
        return repository  # type: ignore[no-any-return]

    def track(self, aggregate: AggregateRoot, repository: Repository[Any]) -> None:
        """Remember an aggregate so its events are captured at commit (repositories call it)."""
        if not any(seen is aggregate for seen, _ in self._tracked):
            self._tracked.append((aggregate, repository))

    def enqueue(self, event: IntegrationEvent) -> None:
        """Publish ``event`` to other services once this transaction commits (via the outbox)."""
        self._integration_events.append(event)

    def schedule(self, command: InternalCommand, due_at: datetime | None = None) -> None:
        """Run ``command`` later, in its own unit of work, once this transaction commits."""
        self._commands.append((command, due_at))

    def stamp_processed_on_commit(self, store: LeaseStore, row_id: uuid.UUID, token: uuid.UUID) -> None:
        """Mark a delivered row processed in this transaction (dispatcher and processors)."""
        self._stamps.append(_Stamp(store, row_id, token))

    def stage_inbox(self, row: InboxMessage) -> None:
        """Record a consumed message in this transaction (the consume pipeline)."""
        self._inbox.append(row)

    @asynccontextmanager
    async def savepoint(self) -> AsyncIterator[None]:
        """A nested transaction; releasing it commits nothing and dispatches nothing.

        When the block raises, the database rolls back to the savepoint and so does this unit
        of work: aggregates tracked before it get their state and pending events back (from a
        copy taken on entry), aggregates first tracked inside it are forgotten, and integration
        events, internal commands, stamps and inbox rows added inside it are dropped. A later
        ``commit()`` then saves exactly what was decided outside the failed block.
        """
        snapshot = self._snapshot()
        try:
            async with self.session.begin_nested():
                yield
        except BaseException:
            self._restore(snapshot)
            raise

    def _snapshot(self) -> _Snapshot:
        return _Snapshot(
            tracked=list(self._tracked),
            states=[_aggregate_state(aggregate) for aggregate, _ in self._tracked],
            integration_events=len(self._integration_events),
            commands=len(self._commands),
            stamps=len(self._stamps),
            inbox=len(self._inbox),
        )

    def _restore(self, snapshot: _Snapshot) -> None:
        for (aggregate, _), state in zip(snapshot.tracked, snapshot.states, strict=True):
            vars(aggregate).clear()
            vars(aggregate).update(state)
        self._tracked = snapshot.tracked
        del self._integration_events[snapshot.integration_events :]
        del self._commands[snapshot.commands :]
        del self._stamps[snapshot.stamps :]
        del self._inbox[snapshot.inbox :]

    # -- the save --------------------------------------------------------------------------

    async def rollback(self) -> None:
        """Abandon everything: business change, outbox rows and deferred work alike."""
        await self.session.rollback()
        self._reset()

    async def commit(self) -> None:
        refuse_commit_in_handler()
        if self.committed:
            msg = "this unit of work has already committed; open a new one"
            raise UnitOfWorkStateError(msg)
        session = self.session
        now = self.now
        captured = [(agg, repo, agg.pending_events) for agg, repo in self._tracked]
        new_versions: list[tuple[AggregateRoot, int]] = []
        for aggregate, repository, pending in captured:
            if pending:
                new_versions.append((aggregate, await repository.persist(aggregate)))
        events: list[DomainEvent] = [event for _, _, pending in captured for event in pending]
        outbox = self._factory.writer.stage(
            events=events if self._factory.outbox_enabled else [],
            integration_events=self._integration_events if self._factory.outbox_enabled else [],
            commands=self._commands,
            context=capture(),
            now=now,
        )
        written = await self._factory.writer.write(session, outbox)
        for stamp in self._stamps:
            connection = await session.connection()  # the stamp commits with the effects
            if not await stamp.store.stamp_processed(connection, [stamp.row_id], stamp.token, now):
                msg = f"lease on {stamp.store.table.name} row {stamp.row_id} was lost"
                raise LeaseLostError(msg)
        for row in self._inbox:
            session.add(row)
        await session.commit()
        self.committed = True

        for aggregate, _, aggregate_events in captured:
            aggregate.remove_events(aggregate_events)
        for aggregate, version in new_versions:
            aggregate.version = version
        integration_events = list(self._integration_events)
        self._integration_events.clear()
        self._commands.clear()
        if outbox.needs_wake:
            self._factory.wake()
        if self._factory.outbox_enabled:
            await self._factory.dispatcher.dispatch_committed(written, depth=self.depth)
        else:
            await self._factory.dispatcher.dispatch_without_outbox(
                events, integration_events, depth=self.depth
            )
