"""Repositories: the base class a context's repository derives from, and the aggregate snapshots
a savepoint rolls back to.

**A repository** loads and persists aggregates of one tenant, tracked by its unit of work. It is
tenant-scoped: a row that belongs to another tenant is simply not found (the API answers 404,
not 403, so it does not even confirm the row exists). It never commits; ``persist`` is called by
the unit of work at commit, and refuses a stale version.

**A failed savepoint** gives back to the unit of work what it held before. The database rolls
back to the savepoint on its own; the unit of work must do the same with what it holds in
memory: aggregates tracked before the savepoint get back their state and pending events (deep
copies taken on entry, the pending event objects shared, since the commit removes them by
identity), aggregates first tracked inside it are forgotten, and integration events, internal
commands, stamps and inbox rows collected inside it are dropped."""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

import sqlalchemy as sa
from sqlmodel.ext.asyncio.session import AsyncSession

from outbox_kit.application.context import current_context
from outbox_kit.application.unit_of_work import AdapterScope
from outbox_kit.domain import AggregateRoot, ConcurrencyError, NotFoundError


@dataclass(frozen=True)
class Snapshot:
    """The unit of work as it was when a savepoint opened."""

    tracked: list[tuple[AggregateRoot, Any]]
    states: list[dict[str, Any]]
    lengths: dict[str, int]  # how many items each collected list held


def aggregate_state(aggregate: AggregateRoot) -> dict[str, Any]:
    """A deep copy of the aggregate's attributes, sharing the pending event objects themselves."""
    state = {key: value for key, value in vars(aggregate).items() if key != "_pending_events"}
    copied = copy.deepcopy(state)
    copied["_pending_events"] = list(aggregate.pending_events)
    return copied


def take(tracked: list[tuple[AggregateRoot, Any]], collected: dict[str, list[Any]]) -> Snapshot:
    return Snapshot(
        tracked=list(tracked),
        states=[aggregate_state(aggregate) for aggregate, _ in tracked],
        lengths={name: len(items) for name, items in collected.items()},
    )


def restore(snapshot: Snapshot, collected: dict[str, list[Any]]) -> list[tuple[AggregateRoot, Any]]:
    """Put the aggregates and the collected lists back; returns the tracked list to keep."""
    for (aggregate, _), state in zip(snapshot.tracked, snapshot.states, strict=True):
        vars(aggregate).clear()
        vars(aggregate).update(state)
    for name, items in collected.items():
        del items[snapshot.lengths[name] :]
    return list(snapshot.tracked)


A = TypeVar("A", bound=AggregateRoot)


class Repository(ABC, Generic[A]):
    """Base for aggregate repositories; subclasses map rows to aggregates and back."""

    aggregate_name: ClassVar[str] = "Aggregate"

    def __init__(self, scope: AdapterScope) -> None:
        self.scope = scope

    @property
    def session(self) -> AsyncSession:
        return self.scope.session

    @property
    def tenant_id(self) -> str | None:
        return current_context().tenant_id

    def add(self, aggregate: A) -> None:
        """Start tracking a new aggregate; it is inserted when the unit of work commits."""
        self.scope.track(aggregate, self)

    async def get(self, aggregate_id: str) -> A:
        """Load and track an aggregate of the current tenant, or raise ``NotFoundError``."""
        aggregate = await self.find(aggregate_id)
        if aggregate is None:
            raise NotFoundError(self.aggregate_name, aggregate_id)
        return aggregate

    async def find(self, aggregate_id: str) -> A | None:
        """Load and track an aggregate of the current tenant, or ``None``: the get-or-none path.
        (Not ``_load``: an aggregate it returns is not tracked, so the events it raises would
        never reach the outbox.)"""
        aggregate = await self._load(aggregate_id)
        if aggregate is not None:
            self.scope.track(aggregate, self)
        return aggregate

    @abstractmethod
    async def _load(self, aggregate_id: str) -> A | None:
        """Read the aggregate of the current tenant (None when absent or foreign)."""

    @abstractmethod
    async def persist(self, aggregate: A) -> int:
        """Write the aggregate's state; return its new version (the unit of work calls this)."""

    async def _versioned_update(self, table: sa.Table, aggregate: A, values: dict[str, Any]) -> int:
        """``UPDATE ... WHERE id AND version``; a concurrent writer makes it match nothing."""
        new_version = aggregate.version + 1
        statement = (
            sa.update(table)
            .where(table.c.id == aggregate.id, table.c.version == aggregate.version)
            .values(**values, version=new_version)
            .returning(table.c.id)
        )
        result = await self.session.exec(statement)
        if result.first() is None:
            raise ConcurrencyError(self.aggregate_name, aggregate.id, aggregate.version)
        return new_version
