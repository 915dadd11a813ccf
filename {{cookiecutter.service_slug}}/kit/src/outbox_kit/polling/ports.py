"""What the polling core asks of the tables it drains, as Protocols: it knows no outbox.

The outbox and the internal-command processors differ only in their :class:`Deliverer`; the
metrics come in as :class:`CycleMetrics`. What a delivery can end in is in ``outcomes``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from ..kernel.time_limits import TimeLimit
from ..kernel.tracing import SpanKind
from .claimed import ClaimedRow
from .results import Delivered


class Deliverer(Protocol):
    """Delivers one claimed row (raises on failure)."""

    async def deliver(self, row: ClaimedRow, token: uuid.UUID, limit: TimeLimit) -> Delivered:
        """Deliver ``row``; ``token`` is its lease, for a stamp written in the same transaction.

        ``limit`` is the delivery's time limit: put it around the handlers or the publish, not
        around the commit that stamps the row (once stamped, a delivery must not fail)."""
        ...

    def needs_fresh_lease(self, row: ClaimedRow) -> bool:
        """True when delivering ``row`` runs handlers (they hold a database session, and get a
        whole lease just before); False for a publish, renewed only when its lease is short."""
        ...

    def span_kind(self, row: ClaimedRow) -> SpanKind:
        """How a delivery of ``row`` shows in a trace (producer for a publish)."""
        ...


class CycleMetrics(Protocol):
    """What a polling cycle reports, per source (``outbox``, ``internal_commands``)."""

    def backlog_age(self, source: str, seconds: float) -> None:
        """The age of the oldest row the last claim found (0 when none)."""
        ...

    def delivered(self, source: str, kind: str, lag_seconds: float) -> None:
        """One row delivered, ``lag_seconds`` after it occurred."""
        ...

    def failed(self, source: str) -> None:
        """One failed attempt recorded (a retry charged)."""
        ...

    def dead_lettered(self, source: str, reason: str, count: int = 1) -> None:
        """Rows set aside as dead letters, by reason."""
        ...

    def lost_lease(self, source: str) -> None:
        """A row another processor had taken over by the time its outcome was written."""
        ...

    def beat(self, source: str, now: datetime) -> None:
        """A cycle finished (the heartbeat ``/livez`` and the alerts watch)."""
        ...


@dataclass(frozen=True)
class SourceSettings:
    """The knobs of one polled table (the ``OUTBOX__*`` settings)."""

    batch_size: int
    delivery_concurrency: int
    claim_window: int
    lease_seconds: float
    # A delivery running longer is cancelled and charged as a failure (``kernel.time_limits``).
    delivery_timeout_seconds: float
    # A delivery starting with less lease left renews it first (the limit plus a margin): no
    # delivery can outlive its lease, so no replica claims a row another is still delivering.
    renew_below_seconds: float
    max_retries: int
    retry_backoff_base_seconds: float
    shutdown_timeout_seconds: float
