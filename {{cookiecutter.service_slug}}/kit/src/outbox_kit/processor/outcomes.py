"""Outcomes: how a delivery's end is written (stamps, failures, pauses); what a failure is
charged is the retry rule's (``processor.retries``).

A batch published together is recorded together (:meth:`Outcomes.record_published`): once every
publish of the batch has ended, its confirmed rows are stamped by one token-guarded UPDATE, its
paused rows released by one, the rest row by row.

The stamps of rows delivered one by one are written together too: one token-guarded UPDATE for a
group of rows (a group commit), flushed when the first of these comes:

* the group holds ``group_rows`` stamps (the source's delivery concurrency, at most its batch);
* no delivery of the cycle's batch is still running (``expect`` / ``delivery_ended``): the batch's
  last stamps go at once, so a keyed row's successor is not held back and a lone row at a low
  rate is stamped without waiting;
* ``LINGER_SECONDS`` (50 ms) passed since the group's first stamp: a slow publish in the batch
  does not hold its batch-mates' stamps.

Why: a stamp of its own per row is a transaction per message, and at the broker's pace those
round trips, not the publishes, were the relay's limit. Flushing by time alone (5 ms) grouped
about 3 rows per statement at 450 rows/s (the statements, their SQLAlchemy execution and their
socket writes were a fifth of the worker's CPU); by batch, a batch of 100 takes two statements.
The wait delays the *stamp* only, never the publish (the consumer's latency does not include it).

What it keeps: a row is only handed in after its broker confirm, and each caller learns whether
*its* row was still its own (``RETURNING id``), exactly as with a single stamp; rows of different
claims (tokens) share the transaction but each is matched against its own token. A failed flush
fails every stamp of the group, and each of those rows is then treated as the single stamp's
failure was: it comes back when its lease ends and is published again (consumers dedupe).
A flush the database dropped (a connection terminated, a failover) is tried again on a fresh
connection, twice, after 0.1 s and 0.5 s: the statement is token-guarded, so a second attempt
cannot stamp a row that is no longer ours, and a row the dropped attempt did write (stamped at
the same ``now``) is still reported as ours. Without it, one dropped connection would leave a
whole group of confirmed rows to be published again when their leases end.
The flush runs as its own task, so a caller cancelled at shutdown does not cancel the stamps of
its group-mates (its own row stays in the group and is still written). The cycle's shutdown
gives that task the rest of its deadline (``settle``) and then cancels it, so no write outlives
the cycle and no connection is held past it.

The outcome of each row, written as soon as the row finishes, guarded by id and lock token.

* delivered: stamped processed (unless the handler's own transaction already did), together
  with the stamps of the rows that finished meanwhile (:class:`StampGroups`);
* unrouted (published with no consumer bound): stamped processed on its own, with the note
  ``explain`` reads, counted, and one Warning per event name per window;
* failed: charged by the retry rule (``retry_count + 1``, ``last_error``), re-leased for its
  jittered backoff, or dead-lettered with an Error log naming the row;
* paused (the downstream or the database is down): released without charging a retry;
* lease lost (the token no longer matches): a Warning and a count, never an overwrite.

A database outage while recording is not charged to the row (the caller's cycle fails and the
row comes back when its lease ends). Any other refusal of a failure record cannot be waited out,
so it must not loop: the retry is charged with a plain reason instead of the failure's text."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import uuid
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from outbox_kit.application.clock import Clock
from outbox_kit.application.metrics import RelayMetrics
from outbox_kit.application.text import describe
from outbox_kit.persistence.database import Database, is_database_outage
from outbox_kit.persistence.tables import PAUSED_PREFIX, LeaseStore
from outbox_kit.processor.claim import ClaimedRow
from outbox_kit.processor.processor import SourceSettings
from outbox_kit.processor.retries import Charge, RetryRule
from outbox_kit.transports.bus import Delivered, PausedError, Unrouted


@dataclass(frozen=True)
class Failure:
    """A failed attempt, as it is recorded on its row: the rule's charge, the error's text, and
    when the row is due again."""

    charge: Charge
    message: str
    retry_at: datetime


log = logging.getLogger(__name__)
LINGER_SECONDS = 0.05
UNROUTED_WARNING_WINDOW = timedelta(hours=1)
RETRY_DELAYS_SECONDS = (0.1, 0.5)


class StampGroups:
    """Coalesces the processed stamps of one polled table."""

    def __init__(self, *, database: Database, leases: LeaseStore, clock: Clock, group_rows: int) -> None:
        self._db = database
        self._leases = leases
        self._clock = clock
        # SQLite delivers one row at a time: there is nothing to gather, so no linger there.
        self._linger = LINGER_SECONDS if database.is_postgresql else 0.0
        self._group_rows = max(1, group_rows)
        self._waiting: dict[uuid.UUID, tuple[uuid.UUID, asyncio.Future[bool]]] = {}
        self._full = asyncio.Event()  # the group is due: full, or nothing more is coming
        self._running = 0  # deliveries of the cycle's batch that have not ended yet
        self._flushing: asyncio.Task[None] | None = None
        self.statements = 0  # how many UPDATEs the stamps took (the tests read the coalescing)

    def expect(self, deliveries: int) -> None:
        """A cycle is about to deliver ``deliveries`` rows: their stamps may wait for each other."""
        self._running = deliveries
        if not self._waiting:  # a "due" left by the last batch's end must not cut this one short
            self._full.clear()

    def delivery_ended(self) -> None:
        """One of the expected deliveries ended (its stamp, if any, is handed in next)."""
        self._running = max(0, self._running - 1)
        if self._running == 0:
            self._full.set()

    async def stamp(self, row_id: uuid.UUID, token: uuid.UUID) -> bool:
        """Stamp ``row_id`` processed if it still carries ``token``; True when it did."""
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiting[row_id] = (token, future)
        if len(self._waiting) >= self._group_rows or self._running == 0:
            self._full.set()
        if self._flushing is None:
            self._flushing = asyncio.create_task(self._flush_all(), name="stamp-groups")
        # Not shielded: a cancelled caller cancels only its future, which the flush then skips.
        return await future

    @property
    def flushing(self) -> bool:
        """True while a flush task runs (none may outlive a cancelled cycle)."""
        return self._flushing is not None

    async def settle(self, deadline: float) -> None:
        """Let a running flush finish until ``deadline`` (the loop's clock), then cancel it.

        Called when a cycle is cancelled, after its deliveries stopped: the stamps already handed
        in are written if the database answers in time; any left are simply not stamped, and
        their rows come back when their leases end.
        """
        flushing = self._flushing
        if flushing is None:
            return
        timeout = max(0.0, deadline - asyncio.get_running_loop().time())
        await asyncio.wait([flushing], timeout=timeout)
        flushing.cancel()
        await asyncio.wait([flushing])  # wait, not await: our own cancellation must not be lost

    async def _flush_all(self) -> None:
        try:
            while self._waiting:
                if not self._full.is_set():
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(self._linger):
                            await self._full.wait()
                self._full.clear()
                group, self._waiting = self._waiting, {}
                await self._flush(group)
        finally:
            self._flushing = None
            group, self._waiting = self._waiting, {}
            for _token, future in group.values():  # only left when the flush was cancelled
                future.cancel()

    async def _flush(self, group: dict[uuid.UUID, tuple[uuid.UUID, asyncio.Future[bool]]]) -> None:
        by_token: defaultdict[uuid.UUID, list[uuid.UUID]] = defaultdict(list)
        for row_id, (token, _future) in group.items():
            by_token[token].append(row_id)
        try:
            ours = await self._write(by_token)
        except asyncio.CancelledError:
            for _token, future in group.values():
                future.cancel()
            raise
        except Exception as error:  # noqa: BLE001 (every caller of the group gets the failure)
            for _token, future in group.values():
                if not future.done():
                    future.set_exception(error)
            return
        for row_id, (_token, future) in group.items():
            if not future.done():
                future.set_result(row_id in ours)

    async def write_now(self, ids: list[uuid.UUID], token: uuid.UUID) -> set[uuid.UUID]:
        """Stamp ``ids`` at once, in one statement (a batch published together: nothing to wait
        for), with the same retry after a dropped connection; the ids that were still ours."""
        return await self._write({token: ids})

    async def _write(self, by_token: dict[uuid.UUID, list[uuid.UUID]]) -> set[uuid.UUID]:
        now = self._clock()
        dropped = False
        for delay in RETRY_DELAYS_SECONDS:
            try:
                return await self._write_once(by_token, now, after_a_drop=dropped)
            except Exception as error:
                if not is_database_outage(error):
                    raise
                log.warning("processed stamps not written (%s); trying again in %.1f s", error, delay)
            dropped = True
            await asyncio.sleep(delay)
        return await self._write_once(by_token, now, after_a_drop=True)

    async def _write_once(
        self, by_token: dict[uuid.UUID, list[uuid.UUID]], now: datetime, *, after_a_drop: bool
    ) -> set[uuid.UUID]:
        ours: set[uuid.UUID] = set()
        async with self._db.bookkeeping_statement() as connection:
            for token, ids in by_token.items():
                self.statements += 1
                ours |= await self._leases.stamp_processed(connection, ids, token, now)
            missing = {row_id for ids in by_token.values() for row_id in ids} - ours
            if after_a_drop and missing:  # written by the attempt whose answer was lost?
                ours |= await self._leases.stamped_at(connection, missing, now)
        return ours


class Outcomes:
    """The guarded writes of one source and what they report (metrics, logs)."""

    def __init__(
        self,
        *,
        name: str,
        settings: SourceSettings,
        database: Database,
        leases: LeaseStore,
        clock: Clock,
        metrics: RelayMetrics,
        rng: random.Random,
    ) -> None:
        self._name = name
        self._settings = settings
        self._db = database
        self._leases = leases
        self._clock = clock
        self._metrics = metrics
        self._retries = RetryRule(
            settings.max_retries, settings.retry_backoff_base_seconds, settings.lease_seconds, rng
        )
        group_rows = min(settings.batch_size, settings.delivery_concurrency)
        self.stamps = StampGroups(database=database, leases=leases, clock=clock, group_rows=group_rows)
        self._unrouted_warned: dict[str, datetime] = {}  # event name -> when it was last warned

    def lease_is_short(self, row: ClaimedRow) -> bool:
        """What is left of the lease (by this process's clock) might not outlast a delivery
        that runs to its time limit: time to renew."""
        left = (row.locked_until - self._clock()).total_seconds()
        return left < self._settings.renew_below_seconds

    async def renew(self, row: ClaimedRow, token: uuid.UUID) -> bool:
        """Push the lease to now + lease just before delivery; False when no longer ours."""
        return row.id in await self.renew_all([row], token)

    async def renew_all(self, rows: Sequence[ClaimedRow], token: uuid.UUID) -> set[uuid.UUID]:
        """Push the leases of ``rows`` to now + lease in one statement; the ids still ours."""
        until = self._clock() + timedelta(seconds=self._settings.lease_seconds)
        async with self._db.bookkeeping_statement() as connection:
            return await self._leases.renew(connection, [row.id for row in rows], token, until)

    async def record_published(
        self,
        rows: Sequence[ClaimedRow],
        outcomes: Sequence[Delivered | Unrouted | BaseException],
        token: uuid.UUID,
    ) -> list[bool]:
        """Write the outcomes of a batch published together, one statement per kind: the
        confirmed rows stamped together, the paused ones released together (per pause), then the
        rare ones row by row (unrouted, failed). True for each row delivered and stamped by us."""
        done: dict[uuid.UUID, bool] = {}
        confirmed = [
            row for row, outcome in zip(rows, outcomes, strict=True) if outcome is Delivered.NEEDS_STAMP
        ]
        if confirmed:
            ours = await self.stamps.write_now([row.id for row in confirmed], token)
            for row in confirmed:
                done[row.id] = row.id in ours
                if done[row.id]:
                    self.delivered(row)
                else:
                    self.lost(row, "after delivery (the new owner may deliver it again; consumers dedupe)")
        paused: defaultdict[tuple[datetime | None, str], list[ClaimedRow]] = defaultdict(list)
        for row, outcome in zip(rows, outcomes, strict=True):
            if isinstance(outcome, PausedError):
                paused[outcome.retry_at, str(outcome)].append(row)
            elif isinstance(outcome, Unrouted):
                done[row.id] = await self.stamp_unrouted(row, token, outcome.detail)
            elif isinstance(outcome, BaseException) and is_database_outage(outcome):
                # Not the row's fault (a consumer of the in-process bus lost the database).
                note = f"database unreachable: {type(outcome).__name__}: {outcome}"
                paused[None, note].append(row)
            elif isinstance(outcome, BaseException):
                await self.fail(row, token, outcome)
        for (until, why), group in paused.items():
            await self.pause_all(group, token, until, why)
        return [done.get(row.id, False) for row in rows]

    async def stamp(self, row: ClaimedRow, token: uuid.UUID) -> bool:
        """True when the stamp landed; a lost lease is not this processor's progress."""
        stamped = await self.stamps.stamp(row.id, token)
        if stamped:
            self.delivered(row)
        else:
            self.lost(row, "after delivery (the new owner may deliver it again; consumers dedupe)")
        return bool(stamped)

    async def stamp_unrouted(self, row: ClaimedRow, token: uuid.UUID, detail: str) -> bool:
        """Stamp a row published with no consumer bound: processed (a delivery to nobody, never
        retried or dead-lettered, its key moves on), ``detail`` noted on it for ``explain``,
        counted, and a Warning once per event name per :data:`UNROUTED_WARNING_WINDOW`."""
        async with self._db.bookkeeping_statement() as connection:
            stamped = await self._leases.stamp_unrouted(connection, row.id, token, self._clock(), detail)
        if not stamped:
            self.lost(row, "after delivery (the new owner may deliver it again; consumers dedupe)")
            return False
        self.delivered(row)
        self._metrics.unrouted_publish(self._name, row.name)
        self._warn_unrouted(row, detail)
        return True

    def _warn_unrouted(self, row: ClaimedRow, detail: str) -> None:
        # One line per event name per window, not per message: a busy contract with no consumer
        # would flood the log; the metric counts every one.
        now = self._clock()
        last = self._unrouted_warned.get(row.name)
        if last is not None and now - last < UNROUTED_WARNING_WINDOW:
            return
        self._unrouted_warned[row.name] = now
        log.warning(
            "%s row %s (%s) published with no consumer bound (unrouted): %s. It is marked processed, "
            "not retried; consumers that bind later get the events published from then on. "
            "Counted in outbox_unrouted_total; this warning repeats at most every %s per event.",
            *(self._name, row.id, row.name, detail, UNROUTED_WARNING_WINDOW),
        )

    def delivered(self, row: ClaimedRow) -> None:
        lag = (self._clock() - row.occurred_on).total_seconds()
        self._metrics.delivered(self._name, row.kind or "command", max(lag, 0.0))

    async def pause(self, row: ClaimedRow, token: uuid.UUID, until: datetime | None, why: str) -> None:
        """Release the row uncharged (its downstream is down); ``explain`` reports it paused."""
        await self.pause_all([row], token, until, why)

    async def pause_all(
        self, rows: Sequence[ClaimedRow], token: uuid.UUID, until: datetime | None, why: str
    ) -> None:
        """Release ``rows`` uncharged in one statement (see :meth:`pause`)."""
        async with self._db.bookkeeping() as connection:
            await self._leases.release(
                connection, [row.id for row in rows], token, until=until, error=f"{PAUSED_PREFIX}{why}"
            )

    async def fail(self, row: ClaimedRow, token: uuid.UUID, error: BaseException) -> None:
        """Charge one retry, or dead-letter the row when it is finished with."""
        charge = self._retries.charge(row, error)
        attempt, reason, delay = charge.attempt, charge.dead_letter_reason, charge.retry_in_seconds
        failure = Failure(charge, describe(error), self._clock() + timedelta(seconds=delay))
        if not await self._record(row, token, failure, error):
            self.lost(row, "while recording its failure")
            return
        self._metrics.failed(self._name)
        if reason is None:
            log.warning(
                "%s row %s (%s) failed attempt %s/%s, retrying in %.1fs: %s",
                *(self._name, row.id, row.name, attempt, self._settings.max_retries, delay, failure.message),
            )
            return
        self._metrics.dead_lettered(self._name, reason)
        log.error(
            "%s row %s (%s) dead-lettered (%s) after %s attempt(s): %s",
            *(self._name, row.id, row.name, reason, attempt, failure.message),
        )

    async def _record(
        self, row: ClaimedRow, token: uuid.UUID, failure: Failure, error: BaseException
    ) -> bool:
        try:
            return await self._write_failure(row, token, failure)
        except Exception as refused:
            if is_database_outage(refused):
                raise
            log.warning("%s row %s: its failure could not be recorded as is: %s", self._name, row.id, refused)
            unrecorded = type(refused).__name__
            plain = f"{type(error).__name__} (the failure's text could not be recorded: {unrecorded})"
            return await self._write_failure(row, token, dataclasses.replace(failure, message=plain))

    async def _write_failure(self, row: ClaimedRow, token: uuid.UUID, failure: Failure) -> bool:
        async with self._db.bookkeeping() as connection:
            return await self._leases.record_failure(
                connection,
                row.id,
                token,
                now=self._clock(),
                error=failure.message,
                retry_count=failure.charge.attempt,
                retry_at=failure.retry_at,
                dead_letter_reason=failure.charge.dead_letter_reason,
            )

    def lost(self, row: ClaimedRow, when: str) -> None:
        self._metrics.lost_lease(self._name)
        log.warning("%s row %s (%s): lease lost %s", self._name, row.id, row.name, when)
