"""The processor: the polling core shared by the outbox and internal-command processors (one
:class:`Processor` per table), what it asks of a table, and what wakes it.

It knows no outbox: the two processors differ only in their :class:`Deliverer`; the metrics
are the relay's (:class:`RelayMetrics`); what a delivery can end in is in ``outcomes``, and one
table's cycle is in ``cycle``.

A processor wakes on its in-process signal (a commit on this process, or a PostgreSQL NOTIFY from any
replica), or after the fallback interval. After a cycle it

* re-polls at once when the cycle made progress and either filled its batch or completed a
  keyed row (whose key-mates may now be claimable), so an ordering key is not paced at one row
  per poll;
* re-polls at once, too, when it was woken while the cycle ran (a commit wrote new rows),
  without the round trip that asks for the next due time;
* otherwise smart-waits until the earliest *future* eligibility (a processing delay or a retry
  backoff ending), capped by the fallback interval, so a retry runs on time rather than one
  interval late;
* never re-polls at once after a cycle that delivered nothing, so a batch that fails in full
  cannot hot-spin (failures are recorded, but they are not progress);
* when the table is empty (nothing claimed, nothing waiting) and the wake is reliable (the
  PostgreSQL LISTEN connection is up, so every commit of every replica wakes it), falls back to
  the longer idle interval: an idle worker then costs well under one statement a second. The
  fallback poll stays (NOTIFY is a hint, never the only path), only its pace changes.

Idle cycles log nothing above DEBUG.

The cross-replica wake: LISTEN on a dedicated asyncpg connection, turned into wake-ups; it
reconnects forever and wakes the loops once after every reconnect to catch up."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol, Self

from outbox_kit.application.clock import Clock, TimeLimit
from outbox_kit.application.tracing import SpanKind
from outbox_kit.persistence.writer import WakeSignal
from outbox_kit.processor.claim import ClaimedRow
from outbox_kit.processor.settings import OutboxSettings
from outbox_kit.transports.bus import Delivered, Unrouted


class Deliverer(Protocol):
    """Delivers one claimed row (raises on failure)."""

    async def deliver(self, row: ClaimedRow, token: uuid.UUID, limit: TimeLimit) -> Delivered | Unrouted:
        """Deliver ``row``; ``token`` is its lease, for a stamp written in the same transaction.
        :class:`Unrouted`: published with no consumer bound (stamped processed, with a note).

        ``limit`` is the delivery's time limit: put it around the handlers or the publish, not
        around the commit that stamps the row (once stamped, a delivery must not fail)."""
        ...

    def publishes(self, row: ClaimedRow) -> bool:
        """True when ``row`` is delivered by a publish: the cycle publishes such rows of its batch
        together (:meth:`deliver_published`) instead of one :meth:`deliver` each."""
        ...

    async def deliver_published(
        self, rows: Sequence[ClaimedRow], window: int, limit: TimeLimit
    ) -> list[Delivered | Unrouted | BaseException]:
        """Publish ``rows`` (each one :meth:`publishes`) together, up to ``window`` awaiting the
        broker at once, under one time limit; each row's outcome in order, an error included
        (never raised). ``NEEDS_STAMP`` once the broker confirmed the row."""
        ...

    def needs_fresh_lease(self, row: ClaimedRow) -> bool:
        """True when delivering ``row`` runs handlers (they hold a database session, and get a
        whole lease just before); False for a publish, renewed only when its lease is short."""
        ...

    def span_kind(self, row: ClaimedRow) -> SpanKind:
        """How a delivery of ``row`` shows in a trace (producer for a publish)."""
        ...


class RowByRow:
    """For a :class:`Deliverer` that never publishes: every row goes through ``deliver``, one by
    one (the internal commands', and the test deliverers')."""

    def publishes(self, row: ClaimedRow) -> bool:
        del row
        return False

    async def deliver_published(
        self, rows: Sequence[ClaimedRow], window: int, limit: TimeLimit
    ) -> list[Delivered | Unrouted | BaseException]:
        """Never called: nothing :meth:`publishes`."""
        del window, limit
        msg = f"{type(self).__name__} delivers row by row, it publishes no batch ({len(rows)} rows)"
        raise TypeError(msg)


@dataclass(frozen=True)
class SourceSettings:
    """The knobs of one polled table (the ``OUTBOX__*`` settings)."""

    batch_size: int
    delivery_concurrency: int
    claim_window: int
    lease_seconds: float
    # A delivery running longer is cancelled and charged as a failure (``application.clock``).
    delivery_timeout_seconds: float
    # A delivery starting with less lease left renews it first (the limit plus a margin): no
    # delivery can outlive its lease, so no replica claims a row another is still delivering.
    renew_below_seconds: float
    max_retries: int
    retry_backoff_base_seconds: float
    shutdown_timeout_seconds: float

    @classmethod
    def of(cls, outbox: OutboxSettings, *, single_writer: bool) -> Self:
        """The knobs from ``OUTBOX__*``; a single-writer database (SQLite) delivers one row at a
        time, since concurrent deliveries would only queue on its lock."""
        return cls(
            batch_size=outbox.batch_size,
            delivery_concurrency=1 if single_writer else outbox.delivery_concurrency,
            claim_window=outbox.effective_claim_window,
            lease_seconds=outbox.lease_seconds,
            delivery_timeout_seconds=outbox.delivery_timeout_seconds,
            renew_below_seconds=outbox.renew_below_seconds,
            max_retries=outbox.max_retries,
            retry_backoff_base_seconds=outbox.retry_backoff_base_seconds,
            shutdown_timeout_seconds=outbox.shutdown_timeout_seconds,
        )


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
            if result.poll_again_now or self._wake.is_set():  # woken during the cycle: new rows
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


class PostgresListener:
    """LISTEN on the outbox channel and turn notifications into wake-ups; reconnects forever.

    The connection is watched three ways: asyncpg's termination callback (the server closed it),
    a ``SELECT 1`` every ``keepalive_seconds`` that must answer within ``query_timeout_seconds``
    (a half-open socket, say after a failover behind a load balancer, never closes by itself),
    and any error while listening. Whatever ends a connection, the listener reconnects; the
    backoff only resets once a connection has stayed up for ``stable_seconds``, so a server that
    accepts and drops at once is retried at the capped pace, not twenty times a second. Every
    reconnect wakes the loops once, to catch up on what was committed in between.
    """

    def __init__(
        self,
        dsn: str,
        channel: str,
        wake: WakeSignal,
        *,
        initial_backoff: float = 0.05,
        max_backoff: float = 5.0,
        keepalive_seconds: float = 30.0,
        query_timeout_seconds: float = 10.0,
        stable_seconds: float = 10.0,
    ) -> None:
        self._dsn = dsn
        self._channel = channel
        self._wake = wake
        self._initial_backoff = initial_backoff
        self._max_backoff = max_backoff
        self._keepalive = keepalive_seconds
        self._query_timeout = query_timeout_seconds
        self._stable = stable_seconds
        self.connected = asyncio.Event()
        self.notifications = 0
        self.connections = 0

    def _on_notify(self, *_args: object) -> None:
        self.notifications += 1
        self._wake.set()

    async def run(self) -> None:
        """Listen until cancelled; reconnect with backoff when the connection drops."""
        import asyncpg  # noqa: PLC0415 (only PostgreSQL deployments need it)

        backoff = self._initial_backoff
        while True:
            try:
                connection = await asyncpg.connect(self._dsn, timeout=self._query_timeout)
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as error:
                log.warning("outbox listener cannot connect (%s); retrying in %.2fs", error, backoff)
            else:
                self.connections += 1
                connected_at = time.monotonic()
                await self._listen(connection)
                if time.monotonic() - connected_at >= self._stable:
                    backoff = self._initial_backoff
                    continue  # it was up long enough: reconnect at once
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self._max_backoff)

    async def _listen(self, connection: Any) -> None:  # noqa: ANN401 (asyncpg.Connection, imported lazily)
        lost = asyncio.Event()
        try:
            connection.add_termination_listener(lambda _conn: lost.set())
            await connection.add_listener(self._channel, self._on_notify)
            self.connected.set()
            self._wake.set()  # catch up on whatever was committed while we were away
            while not lost.is_set() and not connection.is_closed():
                try:
                    await asyncio.wait_for(lost.wait(), timeout=self._keepalive)
                except TimeoutError:
                    # A half-open socket answers nothing: the timeout is what detects it.
                    await connection.execute("SELECT 1", timeout=self._query_timeout)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 (any failure means: reconnect)
            log.warning("outbox listener lost its connection: %s: %s", type(error).__name__, error)
        finally:
            self.connected.clear()
            await _close_quietly(connection, self._query_timeout)


async def _close_quietly(connection: Any, within_seconds: float) -> None:  # noqa: ANN401 (asyncpg.Connection)
    """Close, or drop the socket when a polite close cannot finish (the peer is gone)."""
    if connection.is_closed():
        return
    try:
        await connection.close(timeout=within_seconds)
    except Exception:  # noqa: BLE001 (the connection is being discarded either way)
        connection.terminate()
