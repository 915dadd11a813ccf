"""Repositories: load and persist aggregates of one tenant, tracked by their unit of work.

A repository is tenant-scoped: a row that belongs to another tenant is simply not found (the
API answers 404, not 403, so it does not even confirm the row exists). It never commits;
``persist`` is called by the unit of work at commit, and refuses a stale version.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Generic, TypeVar

import sqlalchemy as sa
from sqlmodel.ext.asyncio.session import AsyncSession

from ..application.unit_of_work import AdapterScope
from ..domain.aggregate import AggregateRoot
from ..domain.errors import ConcurrencyError, NotFoundError
from ..kernel.request_context import current_context

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
        aggregate = await self._load(aggregate_id)
        if aggregate is None:
            raise NotFoundError(self.aggregate_name, aggregate_id)
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
