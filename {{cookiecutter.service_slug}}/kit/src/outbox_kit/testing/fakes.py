"""Fakes for fast unit tests of use cases and handlers: a unit of work and repositories in memory.

A use case or a handler sees only the :class:`~outbox_kit.public.UnitOfWork` Protocol, so a test
can hand it an :class:`InMemoryUnitOfWork` instead of the SQL one and run without a database::

    store = InMemoryStore()
    uow = InMemoryUnitOfWork(store, adapters={Orders: InMemoryOrders})
    async with uow:
        order = await place_order(uow, command)
        await uow.commit()
    assert store.published == [...]          # integration events the outbox would carry
    assert [type(e) for e in store.events] == [OrderPlaced]

where ``class InMemoryOrders(InMemoryRepository[Order])`` needs no code: it stores copies of the
aggregates per tenant. The fake keeps the promises of the SQL unit of work that a use case can
observe (the service's contract test runs the same checks on both): nothing is saved or
published before ``commit``; a commit captures each aggregate's pending events and removes
exactly those; a stale version raises ``ConcurrencyError``; an aggregate of another tenant is
not found; a failed ``savepoint`` block leaves nothing it collected. What it does not do is
deliver: committed domain events, integration events and internal commands are recorded on the
store for the test to assert on (run a handler yourself to test it)."""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, ClassVar, Generic, Self, TypeVar

from sqlmodel.ext.asyncio.session import AsyncSession

from outbox_kit.application.context import current_context
from outbox_kit.application.messages import IntegrationEvent, InternalCommand
from outbox_kit.domain import AggregateRoot, ConcurrencyError, DomainEvent, NotFoundError
from outbox_kit.persistence import repository as savepoints
from outbox_kit.persistence.unit_of_work import CollectingUnitOfWork, run_before_commit

A = TypeVar("A", bound=AggregateRoot)
P = TypeVar("P")
T = TypeVar("T")


@dataclass
class InMemoryStore:
    """What the committed units of work of one test saved: the "database" of the fakes."""

    aggregates: dict[tuple[str, str | None, str], AggregateRoot] = field(default_factory=dict)
    events: list[DomainEvent] = field(default_factory=list)  # domain events captured by commits
    published: list[IntegrationEvent] = field(default_factory=list)  # what the outbox would carry
    scheduled: list[tuple[InternalCommand, datetime | None]] = field(default_factory=list)
    commits: int = 0


class InMemoryUnitOfWork(CollectingUnitOfWork["InMemoryRepository[Any]"]):
    """A :class:`~outbox_kit.public.TransactionalUnitOfWork` (and ``AdapterScope``) in memory.

    ``adapters`` maps each port a use case asks for (``uow.repository(Orders)``) to what builds
    its fake from this unit of work (usually an :class:`InMemoryRepository` subclass). ``now``
    is the clock: a fixed time, a callable, or the current UTC time when omitted.
    """

    def __init__(
        self,
        store: InMemoryStore | None = None,
        *,
        adapters: Mapping[type[Any], Callable[[InMemoryUnitOfWork], Any]] | None = None,
        now: datetime | Callable[[], datetime] | None = None,
    ) -> None:
        self.store = store if store is not None else InMemoryStore()
        self._adapters = dict(adapters or {})
        self._clock = now
        self._open = False
        self._reset()

    def _reset(self) -> None:
        self._reset_collected()
        self.committed = False

    async def __aenter__(self) -> Self:
        self._reset()
        self._open = True
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._open = False
        if not self.committed:
            self._reset()

    @property
    def now(self) -> datetime:
        if self._clock is None:
            return datetime.now(UTC)
        return self._clock if isinstance(self._clock, datetime) else self._clock()

    @property
    def session(self) -> AsyncSession:
        """There is none: an adapter that needs SQL belongs in an integration test."""
        msg = "InMemoryUnitOfWork has no database session: give the port an in-memory adapter"
        raise RuntimeError(msg)

    # -- what a transaction collects -------------------------------------------------------

    def repository(self, port: type[P]) -> P:
        repository = self._repositories.get(port)
        if repository is None:
            adapter = self._adapters.get(port)
            if adapter is None:
                msg = f"no in-memory adapter for {port.__name__}: give one in adapters= (port -> its fake)"
                raise LookupError(msg)
            repository = self._repositories[port] = adapter(self)
        return repository  # type: ignore[no-any-return]

    @asynccontextmanager
    async def savepoint(self) -> AsyncIterator[None]:
        """If the block raises, what it collected is dropped and the aggregates get back their
        states and pending events, as the SQL unit of work does (the same ``savepoint`` rules)."""
        collected: dict[str, list[Any]] = {
            "integration_events": self._integration_events,
            "commands": self._commands,
        }
        snapshot = savepoints.take(self._tracked, collected)
        try:
            yield
        except BaseException:
            self._tracked = savepoints.restore(snapshot, collected)
            raise

    # -- the save --------------------------------------------------------------------------

    async def commit(self) -> None:
        if not self._open or self.committed:
            msg = "commit an open unit of work once ('async with uow: ... await uow.commit()')"
            raise RuntimeError(msg)
        captured = [(aggregate, repo, aggregate.pending_events) for aggregate, repo in self._tracked]
        staged = [(aggregate, repo.stage(aggregate)) for aggregate, repo, pending in captured if pending]
        await run_before_commit(
            self._before_commit, [(aggregate, version) for aggregate, (_, version) in staged]
        )
        for aggregate, (key, version) in staged:  # all checked first: a stale one saves nothing
            saved = copy.deepcopy(aggregate)
            saved.version = version
            saved.remove_events(saved.pending_events)
            self.store.aggregates[key] = saved
            aggregate.version = version
        for aggregate, _, pending in captured:
            self.store.events.extend(pending)
            aggregate.remove_events(pending)
        self.store.published.extend(self._integration_events)
        self.store.scheduled.extend(self._commands)
        self.store.commits += 1
        self.committed = True

    async def rollback(self) -> None:
        self._reset()

    async def run(self, operation: Callable[[Self], Awaitable[T]]) -> T:
        async with self:
            result = await operation(self)
            if not self.committed:
                await self.commit()
            return result


class InMemoryRepository(Generic[A]):
    """An aggregate repository in an :class:`InMemoryStore`, scoped to the caller's tenant like
    the SQL one: subclass it per aggregate (``class InMemoryOrders(InMemoryRepository[Order])``).

    ``get`` hands out a copy (as loading from a database would), and a commit refuses a stale
    version with ``ConcurrencyError``.
    """

    aggregate_name: ClassVar[str] = "Aggregate"

    def __init__(self, uow: InMemoryUnitOfWork) -> None:
        self.uow = uow

    def _key(self, aggregate_id: str) -> tuple[str, str | None, str]:
        return (type(self).__qualname__, current_context().tenant_id, aggregate_id)

    def add(self, aggregate: A) -> None:
        """Start tracking a new aggregate; it is stored when the unit of work commits."""
        self.uow.track(aggregate, self)

    async def get(self, aggregate_id: str) -> A:
        """A copy of the current tenant's aggregate, tracked; ``NotFoundError`` otherwise."""
        aggregate = await self.find(aggregate_id)
        if aggregate is None:
            raise NotFoundError(self.aggregate_name, aggregate_id)
        return aggregate

    async def find(self, aggregate_id: str) -> A | None:
        """A copy of the current tenant's aggregate, tracked, or ``None``."""
        stored = self.uow.store.aggregates.get(self._key(aggregate_id))
        if stored is None:
            return None
        aggregate: A = copy.deepcopy(stored)  # type: ignore[assignment]
        self.uow.track(aggregate, self)
        return aggregate

    def stage(self, aggregate: A) -> tuple[tuple[str, str | None, str], int]:
        """Where ``aggregate`` is stored and its new version; ``ConcurrencyError`` when the
        stored version moved on since it was loaded (or it was added twice)."""
        key = self._key(aggregate.id)
        stored = self.uow.store.aggregates.get(key)
        if (stored.version if stored is not None else 0) != aggregate.version:
            raise ConcurrencyError(self.aggregate_name, aggregate.id, aggregate.version)
        return key, aggregate.version + 1
