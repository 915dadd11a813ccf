"""The unit of work as a bounded context sees it: Protocols (the implementation is internal).

Use cases and handlers get a :class:`UnitOfWork`: they load and add aggregates through
``repository(Port)``, enqueue integration events, schedule internal commands and may open a
savepoint. They cannot reach the database session, the lease stamps or the inbox staging: a
handler's effects are saved by whoever delivered the message to it (see ``commit`` in
``persistence.unit_of_work``), together with the delivery record, which is what makes a
redelivery safe. Entry points (HTTP routes, the CLI) drive a :class:`TransactionalUnitOfWork`
from a :class:`UnitOfWorkFactory`: open it, run an operation, commit.

Adapters (repositories, read-model stores) are built per unit of work from an
:class:`AdapterScope`: the transaction's session and the aggregate tracking a repository needs."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from datetime import datetime
from types import TracebackType
from typing import Any, Protocol, Self, TypeVar

from sqlmodel.ext.asyncio.session import AsyncSession

from outbox_kit.application.messages import IntegrationEvent, InternalCommand
from outbox_kit.domain import AggregateRoot

P = TypeVar("P")
T = TypeVar("T")


class UnitOfWork(Protocol):
    """One business transaction, as use cases and handlers use it (they never commit)."""

    @property
    def now(self) -> datetime:
        """The application clock's time (the same for every row this transaction writes)."""
        ...

    def repository(self, port: type[P]) -> P:
        """The adapter of ``port`` (a Protocol the context declares) bound to this transaction."""
        ...

    def enqueue(self, event: IntegrationEvent) -> None:
        """Publish ``event`` to other services once this transaction commits (via the outbox)."""
        ...

    def schedule(self, command: InternalCommand, due_at: datetime | None = None) -> None:
        """Run ``command`` later, in its own unit of work, once this transaction commits."""
        ...

    def savepoint(self) -> AbstractAsyncContextManager[None]:
        """A nested transaction: if its block raises, only the block's changes are undone."""
        ...


class TransactionalUnitOfWork(UnitOfWork, Protocol):
    """What an entry point drives: ``async with uow: ... await uow.commit()`` or ``run``."""

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...

    async def commit(self) -> None:
        """Save everything the transaction collected, then deliver its local events."""
        ...

    async def rollback(self) -> None:
        """Abandon the business change, its outbox rows and its deferred work alike."""
        ...

    def before_commit(self, write: Callable[[], Awaitable[None]]) -> None:
        """Run ``write`` in this transaction at commit, after the aggregates are saved (they
        carry their saved versions meanwhile): to record the answer of the operation, such as an
        idempotency key's, atomically with it."""
        ...

    async def run(self, operation: Callable[[Self], Awaitable[T]]) -> T:
        """Run ``operation`` and commit, re-running all of it on a transient database error."""
        ...


class UnitOfWorkFactory(Protocol):
    """Gives a new, unopened unit of work (one per request or command)."""

    def __call__(self) -> TransactionalUnitOfWork: ...


class AdapterScope(Protocol):
    """What a context's adapter is built from, once per unit of work."""

    @property
    def now(self) -> datetime:
        """The application clock's time, as the unit of work sees it."""
        ...

    @property
    def session(self) -> AsyncSession:
        """The transaction's session: adapters read and stage writes; they never commit."""
        ...

    def track(self, aggregate: AggregateRoot, repository: Any) -> None:  # noqa: ANN401 (any repository)
        """Capture ``aggregate``'s events at commit (repositories call it on add and load)."""
        ...


Adapter = Callable[[AdapterScope], Any]
"""Builds a port's adapter for one unit of work (usually the adapter class itself)."""
