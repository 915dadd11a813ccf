"""One table drained by one processor: claim a batch, then renew -> deliver -> record per row.

This is the per-row half of the shared polling core; what "deliver" means is the only thing
the outbox and the internal-command processors do differently (a :class:`Deliverer`).

Outcomes, each written as soon as its row finishes, guarded by id and lock token:

* delivered: stamped processed (or already stamped inside the handler's own transaction);
* failed: ``retry_count + 1`` and ``last_error``; re-leased for the jittered backoff, or
  dead-lettered with ``retries_exhausted`` at ``max_retries`` (an Error log names the row);
* unresolvable name or malformed payload: retried once, then dead-lettered
  (``type_unresolvable`` / ``malformed_payload``); ``max_retries=1`` means no retry at all;
* circuit open (broker down): released until the breaker may close, no retry charged;
* lease lost (the token no longer matches): logged and skipped, never overwritten.

A database error while recording an outcome is not charged to the row: it fails the cycle and
the row comes back when its lease ends. On shutdown (cancellation) nothing is charged: an
interrupted delivery is released claimable, an outcome already earned is written within the
shutdown timeout, and rows not reached are released untouched.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import uuid
from collections.abc import Awaitable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import Enum
from typing import Protocol, TypeVar

import sqlalchemy as sa

from ..application.registry import MalformedPayloadError, UnknownMessageError
from ..kernel.clock import Clock
from ..kernel.metrics import RelayMetrics
from ..kernel.text import describe
from ..kernel.tracing import AttributeValue, NoTracing, Span, SpanKind, Tracing
from ..persistence.database import Database, is_database_outage
from ..unit_of_work.capture import INTEGRATION as INTEGRATION_KIND
from .claim import ClaimedRow, Claimer
from .leases import (
    MALFORMED_PAYLOAD,
    PAUSED_PREFIX,
    RETRIES_EXHAUSTED,
    TYPE_UNRESOLVABLE,
    LeaseLostError,
    LeaseStore,
    backoff_seconds,
)
from .loop import CycleResult

log = logging.getLogger(__name__)
T = TypeVar("T")


class Delivered(Enum):
    """How a successful delivery left the row."""

    NEEDS_STAMP = "needs_stamp"  # e.g. a broker confirmed the publish
    STAMPED = "stamped"  # the handler's unit of work stamped it in its own transaction


class CircuitOpenError(RuntimeError):
    """The downstream is known to be down; try again at ``retry_at`` without charging."""

    def __init__(self, retry_at: datetime) -> None:
        super().__init__(f"circuit open until {retry_at.isoformat()}")
        self.retry_at = retry_at


@dataclass(frozen=True)
class Failure:
    """A failed attempt, as it is recorded on its row."""

    attempt: int
    reason: str | None  # the dead-letter reason, when the row is finished with
    message: str
    retry_at: datetime


class Deliverer(Protocol):
    """Delivers one claimed row (raises on failure)."""

    async def deliver(self, row: ClaimedRow, token: uuid.UUID) -> Delivered: ...


@dataclass(frozen=True)
class SourceSettings:
    batch_size: int
    delivery_concurrency: int
    claim_window: int
    lease_seconds: float
    max_retries: int
    retry_backoff_base_seconds: float
    shutdown_timeout_seconds: float


class TableSource:
    """A polled table: the claim, the per-row pipeline and the smart-wait query."""

    def __init__(
        self,
        *,
        name: str,
        table: sa.Table,
        name_column: str,
        settings: SourceSettings,
        database: Database,
        deliverer: Deliverer,
        clock: Clock,
        instance_id: str,
        metrics: RelayMetrics,
        rng: random.Random | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.name = name
        self._tracing: Tracing = tracing or NoTracing()
        self.table = table
        self.settings = settings
        self._db = database
        self._deliverer = deliverer
        self._clock = clock
        self._instance_id = instance_id
        self._metrics = metrics
        self._rng = rng or random.Random()  # noqa: S311 (jitter spaces retries; no security use)
        self._claimer = Claimer(table, name_column, batch=settings.batch_size, window=settings.claim_window)
        self._shutdown_deadline: float | None = None
        self.leases = LeaseStore(table)

    # -- the cycle -------------------------------------------------------------------------

    async def claim(self, token: uuid.UUID) -> list[ClaimedRow]:
        now = self._clock()
        lease_until = now + timedelta(seconds=self.settings.lease_seconds)
        async with self._db.bookkeeping() as connection:
            rows = await self._claimer.claim(
                connection, now=now, lease_until=lease_until, token=token, locked_by=self._instance_id
            )
        # The poll's own rows give the backlog age: no MIN() query (ADR 2026-08-26 item 3).
        age = (now - min(row.occurred_on for row in rows)).total_seconds() if rows else 0.0
        self._metrics.oldest_pending_age.labels(self.name).set(max(age, 0.0))
        return rows

    async def run_cycle(self) -> CycleResult:
        """Claim a batch and deliver it, up to ``delivery_concurrency`` rows at a time.

        Concurrency cannot reorder a key: the claim never puts two rows of one key in a batch.
        Rows are started in ``seq`` order.
        """
        token = uuid.uuid4()
        rows = await self.claim(token)
        gate = asyncio.Semaphore(self.settings.delivery_concurrency)

        started: set[uuid.UUID] = set()

        async def process(row: ClaimedRow) -> bool:
            async with gate:
                started.add(row.id)
                return await self._process(row, token)

        self._shutdown_deadline = None
        tasks = [asyncio.ensure_future(process(row)) for row in rows]
        if tasks:
            try:
                # Every row finishes (or fails) before the cycle ends: one row's database error
                # must not leave its batch-mates running unobserved behind the next cycle. (Not
                # gather: a cancelled gather waits for its children before it lets go.)
                await asyncio.wait(tasks)
            except asyncio.CancelledError:
                await self._stop(tasks, rows, started, token)
                raise
        errors = [error for task in tasks if (error := task.exception()) is not None]
        for extra in errors[1:]:
            log.error("%s: another delivery of the cycle failed too", self.name, exc_info=extra)
        if errors:
            raise errors[0]
        outcomes = [task.result() is True for task in tasks]
        completed = sum(1 for done in outcomes if done)
        keyed_completed = any(
            done and row.ordering_key is not None for row, done in zip(rows, outcomes, strict=True)
        )
        self._metrics.beat(self.name, self._clock())
        if rows:
            log.debug("%s: claimed %s, completed %s", self.name, len(rows), completed)
        return CycleResult(
            claimed=len(rows),
            completed=completed,
            full_batch=len(rows) >= self.settings.batch_size,
            keyed_completed=keyed_completed,
        )

    async def _process(self, row: ClaimedRow, token: uuid.UUID) -> bool:
        """Renew, deliver, record; True only when the row was delivered.

        A failure is recorded but is not progress: a batch that failed in full must not make
        the loop re-poll at once (it would sweep the backlog charging every row a retry while
        the cause, usually a dependency outage, is still there).
        """
        if not await self._renew(row, token):
            self._lost(row, "before dispatch")
            return False
        kind = SpanKind.PRODUCER if row.kind == INTEGRATION_KIND else SpanKind.INTERNAL
        attributes: dict[str, AttributeValue] = {
            "messaging.message.id": str(row.id),
            f"{self.name}.retry_count": row.retry_count,
        }
        with self._tracing.span(
            f"{self.name} deliver {row.name}", kind=kind, traceparent=row.trace_context, attributes=attributes
        ) as span:
            # The delivery runs under this span: a published message carries it on.
            return await self._deliver(dataclasses.replace(row, trace_context=span.traceparent), token, span)

    async def _deliver(self, row: ClaimedRow, token: uuid.UUID, span: Span) -> bool:
        try:
            delivered = await self._deliverer.deliver(row, token)
        except LeaseLostError:
            self._lost(row, "while its handlers ran (their effects were rolled back)")
            return False
        except CircuitOpenError as open_circuit:
            span.set_attribute("outcome", "circuit_open")
            await self._write(self._release(row, token, open_circuit.retry_at, paused=str(open_circuit)))
            return False
        except Exception as error:  # noqa: BLE001 (every failure is recorded on the row)
            span.record_failure(error)
            if is_database_outage(error):
                await self._database_outage(row, token, error)
            else:
                await self._write(self._fail(row, token, error))
            return False
        if delivered is Delivered.NEEDS_STAMP:
            return await self._write(self._stamp(row, token))
        self._delivered(row)
        return True

    # -- outcomes --------------------------------------------------------------------------

    async def _database_outage(self, row: ClaimedRow, token: uuid.UUID, error: BaseException) -> None:
        """The handler's unit of work could not reach the database: not the row's fault, so no
        retry is charged. The row is released for the next cycle; if even that cannot be
        written, its lease runs out and it returns the same way."""
        log.warning(
            "%s row %s (%s): database unreachable during delivery, not charged: %s",
            self.name,
            row.id,
            row.name,
            error,
        )
        note = f"database unreachable: {type(error).__name__}: {error}"
        try:
            await self._write(self._release(row, token, None, paused=note))
        except Exception:
            log.debug("%s row %s: release failed as well", self.name, row.id, exc_info=True)

    async def _renew(self, row: ClaimedRow, token: uuid.UUID) -> bool:
        until = self._clock() + timedelta(seconds=self.settings.lease_seconds)
        async with self._db.bookkeeping() as connection:
            return await self.leases.renew(connection, row.id, token, until)

    async def _stamp(self, row: ClaimedRow, token: uuid.UUID) -> bool:
        """True when the stamp landed; a lost lease is not this processor's progress."""
        async with self._db.bookkeeping() as connection:
            stamped = await self.leases.stamp_processed(connection, [row.id], token, self._clock())
        if stamped:
            self._delivered(row)
        else:
            self._lost(row, "after delivery (the new owner may deliver it again; consumers dedupe)")
        return bool(stamped)

    def _delivered(self, row: ClaimedRow) -> None:
        lag = (self._clock() - row.occurred_on).total_seconds()
        self._metrics.dispatch_lag.labels(self.name).observe(max(lag, 0.0))
        self._metrics.dispatched.labels(self.name, row.kind or "command").inc()

    async def _release(
        self, row: ClaimedRow, token: uuid.UUID, until: datetime | None, *, paused: str | None = None
    ) -> None:
        error = f"{PAUSED_PREFIX}{paused}" if paused else None
        async with self._db.bookkeeping() as connection:
            await self.leases.release(connection, [row.id], token, until=until, error=error)

    def classify(self, row: ClaimedRow, error: BaseException) -> tuple[int, str | None]:
        """The new retry count and, when the row is finished with, its dead-letter reason."""
        attempt = row.retry_count + 1
        limit = self.settings.max_retries
        if isinstance(error, UnknownMessageError | MalformedPayloadError):
            reason = TYPE_UNRESOLVABLE if isinstance(error, UnknownMessageError) else MALFORMED_PAYLOAD
            # The first miss may be a module still loading (a rolling deploy); a second miss in a
            # row is terminal. Earlier failures of another kind do not count as a miss.
            # Replay keeps last_error but resets retry_count: a miss before the replay is no miss.
            missed_before = row.retry_count > 0 and (row.last_error or "").startswith(
                f"{type(error).__name__}:"
            )
            return attempt, reason if missed_before or attempt >= limit else None
        return attempt, RETRIES_EXHAUSTED if attempt >= limit else None

    async def _fail(self, row: ClaimedRow, token: uuid.UUID, error: BaseException) -> None:
        attempt, reason = self.classify(row, error)
        now = self._clock()
        delay = backoff_seconds(
            attempt,
            base=self.settings.retry_backoff_base_seconds,
            cap=self.settings.lease_seconds,
            rng=self._rng,
        )
        failure = Failure(attempt, reason, describe(error), now + timedelta(seconds=delay))
        recorded = await self._record_failure(row, token, failure, error)
        if not recorded:
            self._lost(row, "while recording its failure")
            return
        self._metrics.failures.labels(self.name).inc()
        if reason is None:
            log.warning(
                "%s row %s (%s) failed attempt %s/%s, retrying in %.1fs: %s",
                self.name,
                row.id,
                row.name,
                attempt,
                self.settings.max_retries,
                delay,
                failure.message,
            )
            return
        self._metrics.dead_letters.labels(self.name, reason).inc()
        log.error(
            "%s row %s (%s) dead-lettered (%s) after %s attempt(s): %s",
            self.name,
            row.id,
            row.name,
            reason,
            attempt,
            failure.message,
        )

    async def _record_failure(
        self, row: ClaimedRow, token: uuid.UUID, failure: Failure, error: BaseException
    ) -> bool:
        """Charge the retry. If the database refuses the record for a reason other than an
        outage (something in the text, say), charge it with a plain reason instead: a failure
        that cannot be recorded would otherwise come back uncharged, forever."""
        try:
            return await self._write_failure(row, token, failure)
        except Exception as refused:
            if is_database_outage(refused):
                raise
            log.warning("%s row %s: its failure could not be recorded as is: %s", self.name, row.id, refused)
            plain = (
                f"{type(error).__name__} (the failure's text could not be recorded: {type(refused).__name__})"
            )
            return await self._write_failure(row, token, dataclasses.replace(failure, message=plain))

    async def _write_failure(self, row: ClaimedRow, token: uuid.UUID, failure: Failure) -> bool:
        async with self._db.bookkeeping() as connection:
            return await self.leases.record_failure(
                connection,
                row.id,
                token,
                now=self._clock(),
                error=failure.message,
                retry_count=failure.attempt,
                retry_at=failure.retry_at,
                dead_letter_reason=failure.reason,
            )

    def _lost(self, row: ClaimedRow, when: str) -> None:
        self._metrics.lost_leases.labels(self.name).inc()
        log.warning("%s row %s (%s): lease lost %s", self.name, row.id, row.name, when)

    # -- shutdown --------------------------------------------------------------------------

    async def _stop(
        self,
        tasks: Sequence[asyncio.Future[bool]],
        rows: list[ClaimedRow],
        started: set[uuid.UUID],
        token: uuid.UUID,
    ) -> None:
        """Shutdown mid-cycle: rows never started are given back at once, beside the in-flight
        outcome writes (a write that hangs must not use up the time their release needs); then
        the interrupted rows are given back. Nothing is charged; token-guarded, so rows whose
        outcome was written are left as they are."""
        for task in tasks:
            task.cancel()
        unreached = [row for row in rows if row.id not in started]
        await asyncio.gather(self._release_on_shutdown(unreached, token), *tasks, return_exceptions=True)
        await self._release_on_shutdown([row for row in rows if row.id in started], token)

    async def _write(self, outcome: Awaitable[T]) -> T:
        """Write an outcome; if shutdown interrupts, finish it within the shutdown timeout."""
        task = asyncio.ensure_future(outcome)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            try:
                async with asyncio.timeout_at(self._shutdown_by()):
                    await task
            except Exception:
                log.exception("%s: an outcome write did not finish during shutdown", self.name)
            raise

    def _shutdown_by(self) -> float:
        """One deadline for the whole shutdown of a cycle (outcome writes and releases share
        it), so the worker's wait of the shutdown timeout covers everything the cycle does."""
        if self._shutdown_deadline is None:
            loop = asyncio.get_running_loop()
            self._shutdown_deadline = loop.time() + self.settings.shutdown_timeout_seconds
        return self._shutdown_deadline

    async def _release_on_shutdown(self, rows: list[ClaimedRow], token: uuid.UUID) -> None:
        if not rows:
            return
        with suppress(Exception):
            async with asyncio.timeout_at(self._shutdown_by()):
                async with self._db.bookkeeping() as connection:
                    await self.leases.release(connection, [row.id for row in rows], token)

    # -- smart wait ------------------------------------------------------------------------

    async def next_due(self) -> datetime | None:
        """The earliest future moment a pending row becomes claimable (backoff or delay)."""
        now = self._clock()
        t = self.table.c
        pending = sa.and_(t.processed_on.is_(None), t.dead_lettered_on.is_(None))
        leased = sa.select(sa.func.min(t.locked_until)).where(pending, t.locked_until > now)
        waiting = sa.select(sa.func.min(t.available_on)).where(
            pending, t.locked_until.is_(None), t.available_on > now
        )
        async with self._db.bookkeeping() as connection:
            first = (await connection.execute(leased)).scalar_one_or_none()
            second = (await connection.execute(waiting)).scalar_one_or_none()
        candidates = [d for d in (first, second) if d is not None]
        return min(candidates) if candidates else None
