"""What every unit of work of one factory shares, as the unit of work needs it.

A Protocol rather than the factory itself, so the unit of work and the factory that builds it do
not import each other; and what runs after a commit (the in-process dispatcher, which lives a
floor above) comes in as :class:`AfterCommit`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from sqlalchemy.exc import DBAPIError

from ..application.messages import IntegrationEvent
from ..application.unit_of_work import Adapter
from ..domain.events import DomainEvent
from ..kernel.clock import Clock
from ..persistence.database import Database
from .capture import RelayWriter
from .rows import WrittenRow


class AfterCommit(Protocol):
    """Delivers, in-process, what a commit wrote for this process."""

    async def dispatch_committed(self, rows: Sequence[WrittenRow], *, depth: int) -> None:
        """Deliver the rows a commit inserted leased to this process (never raises but on
        shutdown: the commit stands)."""
        ...

    async def dispatch_without_outbox(
        self, events: Sequence[DomainEvent], integration_events: Sequence[IntegrationEvent], *, depth: int
    ) -> None:
        """Outbox off (in-process transport only): dispatch and publish directly, best effort."""
        ...


class Shared(Protocol):
    """The factory's resources, one set for every unit of work it gives."""

    database: Database
    writer: RelayWriter
    after_commit: AfterCommit
    clock: Clock
    wake: Callable[[], None]
    outbox_enabled: bool
    adapters: Mapping[type[Any], Adapter]
    transient_retry_attempts: int

    async def transient_pause(self, attempt: int, error: DBAPIError) -> None:
        """Wait before re-running an operation that hit a transient database error."""
        ...
