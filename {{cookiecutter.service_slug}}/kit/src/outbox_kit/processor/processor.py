"""What the polling core asks of the tables it drains, as Protocols: it knows no outbox.

The outbox and the internal-command processors differ only in their :class:`Deliverer`; the
metrics are the relay's (:class:`RelayMetrics`). What a delivery can end in is in ``outcomes``.

The polling core shared by the outbox and internal-command processors (one loop, two tables).

A loop wakes on its in-process signal (a commit on this process, or a PostgreSQL NOTIFY from any
replica), or after the fallback interval. After a cycle it

* re-polls at once when the cycle made progress and either filled its batch or completed a
  keyed row (whose key-mates may now be claimable), so an ordering key is not paced at one row
  per poll;
* otherwise smart-waits until the earliest *future* eligibility (a processing delay or a retry
  backoff ending), capped by the fallback interval, so a retry runs on time rather than one
  interval late;
* never re-polls at once after a cycle that delivered nothing, so a batch that fails in full
  cannot hot-spin (failures are recorded, but they are not progress);
* when the table is empty (nothing claimed, nothing waiting) and the wake is reliable (the
  PostgreSQL LISTEN connection is up, so every commit of every replica wakes it), falls back to
  the longer idle interval: an idle worker then costs well under one statement a second. The
  fallback poll stays (NOTIFY is a hint, never the only path), only its pace changes.

Idle cycles log nothing above DEBUG."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from outbox_kit.application.observability import SpanKind
from outbox_kit.application.timing import Clock, TimeLimit
from outbox_kit.processor.claim import ClaimedRow
from outbox_kit.transports.bus import Delivered


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


@dataclass(frozen=True)
class SourceSettings:
    """The knobs of one polled table (the ``OUTBOX__*`` settings)."""

    batch_size: int
    delivery_concurrency: int
    claim_window: int
    lease_seconds: float
    # A delivery running longer is cancelled and charged as a failure (``application.timing``).
    delivery_timeout_seconds: float
    # A delivery starting with less lease left renews it first (the limit plus a margin): no
    # delivery can outlive its lease, so no replica claims a row another is still delivering.
    renew_below_seconds: float
    max_retries: int
    retry_backoff_base_seconds: float
    shutdown_timeout_seconds: float


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CycleResult:
    """What one claim-and-deliver cycle achieved."""

    claimed: int = 0
    completed: int = 0  # delivered; a recorded failure does not count
    full_batch: bool = False
    keyed_completed: bool = False

    @property
    def progressed(self) -> bool:
        return self.completed > 0

    @property
    def poll_again_now(self) -> bool:
        return self.progressed and (self.full_batch or self.keyed_completed)


class PolledSource(Protocol):
    """A table a processor drains."""

    name: str

    async def run_cycle(self) -> CycleResult:
        """Claim one batch and deliver it."""
        ...

    async def next_due(self) -> datetime | None:
        """When the next row the last claim could not take becomes eligible (None when nothing
        waits); a moment already past means "poll again now"."""
        ...


class Processor:
    """Runs cycles of one source until cancelled."""

    def __init__(
        self,
        source: PolledSource,
        *,
        wake: asyncio.Event,
        interval_seconds: float,
        clock: Clock,
        on_cycle: Callable[[CycleResult], None] | None = None,
        idle_interval_seconds: float | None = None,
        wake_is_reliable: Callable[[], bool] | None = None,
    ) -> None:
        self.source = source
        self._wake = wake
        self._interval = interval_seconds
        self._idle_interval = max(interval_seconds, idle_interval_seconds or interval_seconds)
        self._wake_is_reliable = wake_is_reliable or (lambda: False)
        self._clock = clock
        self._on_cycle = on_cycle
        self.cycles = 0
        self.last_turn = time.monotonic()  # read by the worker's liveness (see ``Worker.stalled``)

    async def run(self) -> None:
        while True:
            self.last_turn = time.monotonic()
            self._wake.clear()
            try:
                result = await self.source.run_cycle()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("%s cycle failed; retrying after the polling interval", self.source.name)
                result = CycleResult()
                await self._sleep(self._interval)
                continue
            self.cycles += 1
            self.last_turn = time.monotonic()
            if self._on_cycle is not None:
                self._on_cycle(result)
            if result.poll_again_now:
                continue
            await self._sleep(await self._smart_wait(result))

    async def _smart_wait(self, result: CycleResult) -> float:
        try:
            due = await self.source.next_due()
        except Exception:
            log.exception("%s could not compute its next due time", self.source.name)
            return self._interval
        if due is None:
            idle = result.claimed == 0 and self._wake_is_reliable()
            return self._idle_interval if idle else self._interval
        return max(0.0, min(self._interval, (due - self._clock()).total_seconds()))

    async def _sleep(self, seconds: float) -> None:
        if self._wake.is_set():
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout=seconds)
