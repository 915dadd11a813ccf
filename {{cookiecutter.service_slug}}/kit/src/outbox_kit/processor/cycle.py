"""One table's cycle: claim a batch, publish the rows delivered by a publish together and
deliver the others one by one, write the outcomes; and what a cycle does when the process stops
in the middle of it.

The rows a publish delivers (integration events on a broker transport) are published as one
batch (:meth:`TableSource._publish`): every publish in flight at once, each awaiting its own
broker acknowledgement, under one delivery time limit; then the outcomes, one statement per
kind (``Outcomes.record_published``). A batch never holds two rows of one key (the claim's
guarantee), so publishing them together cannot reorder a key. The renewal is one statement for
the batch, skipped while the claim's lease outlasts the delivery's time limit.

The other rows (local handlers, internal commands) go renew -> deliver -> record per row, up to
``OUTBOX__DELIVERY_CONCURRENCY`` at once and no more than the database pool, each under
``OUTBOX__DELIVERY_TIMEOUT_SECONDS``: one that never returns is cancelled and charged like any
failure, so it holds its own row only, never the cycle. Their stamps, when the handlers' own
transaction does not write them, are grouped (``outcomes``).

What one cycle does when the process stops in the middle of it (a cancellation): nothing is
charged. Deliveries already started (a published batch included) run on and write their
outcomes; rows the cycle never reached are released at once, beside them (a delivery or write
that hangs must not use up the time their release needs); halfway to the deadline what still
runs is cancelled and its rows are released too, claimable again at once. Everything shares one
deadline (``OUTBOX__SHUTDOWN_TIMEOUT_SECONDS``), so the worker's wait of the shutdown timeout
covers all a cycle does. A stop during the claim itself gives back the whole batch (``claim``).
Every release is token-guarded: a row whose outcome was written no longer matches.

This is the per-table half of the shared polling core; what "deliver" means is the only thing
the outbox and the internal-command processors do differently (a ``Deliverer``); the claim
statement is ``claim``'s."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import random
import uuid
from collections.abc import Awaitable, Callable, Collection, Iterator, Sequence
from contextlib import suppress
from datetime import datetime
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from outbox_kit.application.clock import Clock, time_limit
from outbox_kit.application.metrics import RelayMetrics
from outbox_kit.application.tracing import AttributeValue, NoTracing, Span, SpanKind, Tracing
from outbox_kit.persistence.database import Database, is_database_outage
from outbox_kit.persistence.tables import LeaseLostError, LeaseStore, lease_until
from outbox_kit.processor.claim import ClaimedRow, Claimer, DeliverySlot
from outbox_kit.processor.outcomes import Outcomes
from outbox_kit.processor.processor import CycleResult, Deliverer, SourceSettings
from outbox_kit.transports.bus import Delivered, PausedError, Unrouted

log = logging.getLogger(__name__)
T = TypeVar("T")


class CycleShutdown:
    """One cycle's shutdown deadline and the writes it protects."""

    def __init__(self, *, name: str, timeout_seconds: float, database: Database, leases: LeaseStore) -> None:
        self._name = name
        self._timeout = timeout_seconds
        self._db = database
        self._leases = leases
        self._deadline: float | None = None

    def deadline(self) -> float:
        """Set on the first use after the cancellation, then the same for everything."""
        if self._deadline is None:
            self._deadline = asyncio.get_running_loop().time() + self._timeout
        return self._deadline

    async def write(self, outcome: Awaitable[T]) -> T:
        """Write an outcome; if a cancellation interrupts, finish it within the deadline."""
        task = asyncio.ensure_future(outcome)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            try:
                async with asyncio.timeout_at(self.deadline()):
                    await task
            except Exception:
                log.exception("%s: an outcome write did not finish during shutdown", self._name)
            raise

    async def stop(
        self,
        work: Sequence[tuple[asyncio.Future[Any], Sequence[ClaimedRow]]],
        started: Collection[uuid.UUID],
        token: uuid.UUID,
    ) -> None:
        """Let the started deliveries finish within half the deadline while the unreached rows
        are released; then cancel what still runs and release those rows too. ``work`` pairs
        each task with the rows it delivers (one row, or a batch published together).

        A publish is cut short only halfway to the deadline: cancelled at once, a message the broker
        already holds would be left unstamped and sent again by the next worker.
        """
        tasks = [task for task, _ in work]
        for task, rows in work:  # not started: blocked on the concurrency gate, they never begin
            if not any(row.id in started for row in rows):
                task.cancel()
        every = [row for _, rows in work for row in rows]
        unreached = [row for row in every if row.id not in started]
        # Half the time for the deliveries, so the release of what they leave still fits.
        await asyncio.gather(
            self.release(unreached, token), asyncio.wait(tasks, timeout=self._remaining() / 2)
        )
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.release([row for row in every if row.id in started], token)

    async def claim(self, claim: Awaitable[T], token: uuid.UUID, lease_until: datetime) -> T:
        """Run the cycle's claim, which leases to ``token`` until ``lease_until``; if a
        cancellation interrupts it, give back what it leased. (The same for a business commit that
        inserts rows already leased to its process: ``processor.in_process``.)

        The claim commits on its own, so a stop that lands after the server committed it (its
        answer on the way back, its connection returning to the pool) would leave the whole
        batch leased for a lease under a token nobody holds. The claim is let finish within half
        the deadline (it may be committing), then cancelled, and its cancellation is awaited
        within half of what is left: a COMMIT already sent lands when the server says so, and a
        release that read the table before it would miss the rows. Then every row still under
        the claim's token and lease end is released, uncharged: not by id, since a claim cut
        short may have committed unheard.
        """
        task = asyncio.ensure_future(claim)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            await asyncio.wait([task], timeout=self._remaining() / 2)
            task.cancel()  # no-op once it is done
            await asyncio.wait([task], timeout=self._remaining() / 2)  # the rest is the release's
            task.add_done_callback(_observed)
            await self._give_back(
                lambda connection: self._leases.release_claimed(connection, token, lease_until)
            )
            raise

    async def release(self, rows: Sequence[ClaimedRow], token: uuid.UUID) -> None:
        if rows:
            ids = [row.id for row in rows]
            await self._give_back(lambda connection: self._leases.release(connection, ids, token))

    async def _give_back(self, release: Callable[[AsyncConnection], Awaitable[object]]) -> None:
        """Best effort within the deadline: rows not released wait out their lease."""
        with suppress(Exception):
            async with asyncio.timeout_at(self.deadline()):
                async with self._db.bookkeeping() as connection:
                    await release(connection)

    def _remaining(self) -> float:
        return max(0.0, self.deadline() - asyncio.get_running_loop().time())


@dataclasses.dataclass
class PublishSpans:
    """The rows of a batch about to be published (carrying their spans' ``traceparent``), and
    their spans (none with tracing off)."""

    rows: list[ClaimedRow]
    spans: list[Span]

    def record(self, outcomes: Sequence[object]) -> None:
        """Mark each span with its row's outcome (a failure recorded, a pause named)."""
        for span, outcome in zip(self.spans, outcomes, strict=False):
            if isinstance(outcome, PausedError):
                span.set_attribute("outcome", "paused")
            elif isinstance(outcome, BaseException):
                span.record_failure(outcome)


def _observed(task: asyncio.Future[Any]) -> None:
    """The cycle is ending either way: an error of its interrupted claim is not one to report."""
    if not task.cancelled():
        task.exception()


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
        self.table = table
        self.settings = settings
        self.database = database
        self._deliverer = deliverer
        self._clock = clock
        self._instance_id = instance_id
        self._metrics = metrics
        self._tracing: Tracing = tracing or NoTracing()
        self._claimer = Claimer(
            table,
            name_column,
            batch=settings.batch_size,
            window=settings.claim_window,
            postgresql=database.is_postgresql,
        )
        self.leases = LeaseStore(table)
        self.outcomes = Outcomes(
            name=name,
            settings=settings,
            database=database,
            leases=self.leases,
            clock=clock,
            metrics=metrics,
            rng=rng or random.Random(),  # noqa: S311 (jitter spaces retries; no security use)
        )
        self._shutdown = self._new_shutdown()
        self._last_claim_at: datetime | None = None

    def _new_shutdown(self) -> CycleShutdown:
        return CycleShutdown(
            name=self.name,
            timeout_seconds=self.settings.shutdown_timeout_seconds,
            database=self.database,
            leases=self.leases,
        )

    # -- the cycle -------------------------------------------------------------------------

    async def claim(self, token: uuid.UUID, now: datetime | None = None) -> list[ClaimedRow]:
        """Lease a batch to ``token`` at ``now`` (the clock's by default) for one lease."""
        now = self._clock() if now is None else now
        self._last_claim_at = now
        until = lease_until(now, self.settings.lease_seconds)
        # A transaction of its own, not one autocommitted statement: on PostgreSQL the claim
        # holds its table's replay gate through its statement (``replay_gate``).
        async with self.database.bookkeeping() as connection:
            rows = await self._claimer.claim(
                connection, now=now, lease_until=until, token=token, locked_by=self._instance_id
            )
        # The claim's own rows give the backlog age: no MIN() query.
        age = (now - min(row.occurred_on for row in rows)).total_seconds() if rows else 0.0
        self._metrics.backlog_age(self.name, max(age, 0.0))
        return rows

    async def run_cycle(self) -> CycleResult:
        """Claim a batch and deliver it: the rows delivered by a publish together
        (:meth:`_publish`), the others one task each, up to ``delivery_concurrency`` at a time.

        Concurrency cannot reorder a key: the claim never puts two rows of one key in a batch.
        Rows whose delivery runs handlers are also held to the database pool's size.
        Rows are started in ``seq`` order. Every row finishes (or fails) before the cycle ends:
        one row's database error must not leave its batch-mates running unobserved.
        """
        token = uuid.uuid4()
        self._shutdown = self._new_shutdown()
        now = self._clock()
        # The cycle knows the claim's lease end before the claim runs: a stop during the claim
        # gives the batch back by token and lease end, whose index finds it (``LeaseStore``).
        until = lease_until(now, self.settings.lease_seconds)
        rows = await self._shutdown.claim(self.claim(token, now), token, until)  # a stop here releases them
        published = [row for row in rows if self._deliverer.publishes(row)]
        handled = [row for row in rows if not self._deliverer.publishes(row)]
        gate = asyncio.Semaphore(self.settings.delivery_concurrency)
        # Handlers each hold a database session: no more at once than the pool has connections.
        handlers = asyncio.Semaphore(
            min(self.settings.delivery_concurrency, self.database.settings.pool_size)
        )
        started: set[uuid.UUID] = set()
        stamps = self.outcomes.stamps
        stamps.expect(len(handled))  # the batch's stamps wait for each other, not for the next batch

        async def process(row: ClaimedRow) -> bool:
            room = handlers if self._deliverer.needs_fresh_lease(row) else contextlib.nullcontext()
            # A row waiting for room holds no slot; freeing the slot tells the stamp groups.
            async with room, DeliverySlot(gate, stamps.delivery_ended) as slot:
                started.add(row.id)
                return await self._process(row, token, slot)

        work: list[tuple[asyncio.Future[Any], Sequence[ClaimedRow]]] = [
            (asyncio.ensure_future(process(row)), [row]) for row in handled
        ]
        if published:
            started.update(row.id for row in published)
            work.append((asyncio.ensure_future(self._publish(published, token)), published))
        if work:
            try:
                # Not gather: a cancelled gather waits for its children.
                await asyncio.wait([task for task, _ in work])
            except asyncio.CancelledError:
                await self._shutdown.stop(work, started, token)
                await self.outcomes.stamps.settle(self._shutdown.deadline())
                raise
        return self._result(rows, work)

    def _result(
        self, rows: list[ClaimedRow], work: list[tuple[asyncio.Future[Any], Sequence[ClaimedRow]]]
    ) -> CycleResult:
        errors = [error for task, _ in work if (error := task.exception()) is not None]
        for extra in errors[1:]:
            log.error("%s: another delivery of the cycle failed too", self.name, exc_info=extra)
        if errors:
            raise errors[0]
        done: dict[uuid.UUID, bool] = {}
        for task, delivered in work:
            result = task.result()
            oks = result if isinstance(result, list) else [result]
            done.update((row.id, ok is True) for row, ok in zip(delivered, oks, strict=True))
        self._metrics.beat(self.name, self._clock())
        completed = sum(done.values())
        if rows:
            log.debug("%s: claimed %s, completed %s", self.name, len(rows), completed)
        return CycleResult(
            claimed=len(rows),
            completed=completed,
            full_batch=len(rows) >= self.settings.batch_size,
            keyed_completed=any(done[row.id] and row.ordering_key is not None for row in rows),
        )

    async def _publish(self, rows: list[ClaimedRow], token: uuid.UUID) -> list[bool]:
        """Publish ``rows`` together and record their outcomes, one statement per kind; True for
        each row delivered. No task, time limit or stamp of its own per row: the broker pipelines
        the publishes, the batch shares one delivery time limit, and the confirmed rows are
        stamped together once every publish of the batch has ended (``Outcomes.record_published``).

        As for a single publish, the leases are renewed first only when what is left of them
        might not outlast the delivery's time limit (one statement for the batch)."""
        ours = rows
        if any(self.outcomes.lease_is_short(row) for row in rows):
            renewed = await self.outcomes.renew_all(rows, token)
            for row in rows:
                if row.id not in renewed:
                    self.outcomes.lost(row, "before dispatch")
            ours = [row for row in rows if row.id in renewed]
        if not ours:
            return [False] * len(rows)
        limit = functools.partial(time_limit, self.settings.delivery_timeout_seconds, "delivery")
        with self._publish_spans(ours) as traced:
            window = self.settings.delivery_concurrency
            try:
                outcomes = await self._deliverer.deliver_published(traced.rows, window, limit)
            except Exception as error:  # noqa: BLE001 (it answers per row; raising fails them all)
                outcomes = [error] * len(traced.rows)
            traced.record(outcomes)
        recorded = await self.outcomes.record_published(ours, outcomes, token)
        done = {row.id: ok for row, ok in zip(ours, recorded, strict=True)}
        return [done.get(row.id, False) for row in rows]

    @contextlib.contextmanager
    def _publish_spans(self, rows: list[ClaimedRow]) -> Iterator[PublishSpans]:
        """A producer span per row only when tracing is on (each published message then carries
        its span's ``traceparent``); with tracing off, the rows as they are, nothing per row."""
        if isinstance(self._tracing, NoTracing):
            yield PublishSpans(rows, [])
            return
        with contextlib.ExitStack() as stack:
            spans: list[Span] = []
            traced: list[ClaimedRow] = []
            for row in rows:
                span = stack.enter_context(
                    self._tracing.span(
                        f"{self.name} deliver {row.name}",
                        kind=SpanKind.PRODUCER,
                        traceparent=row.trace_context,
                        attributes={
                            "messaging.message.id": str(row.id),
                            f"{self.name}.retry_count": row.retry_count,
                        },
                    )
                )
                spans.append(span)
                traced.append(dataclasses.replace(row, trace_context=span.traceparent))
            yield PublishSpans(traced, spans)

    async def _process(self, row: ClaimedRow, token: uuid.UUID, slot: DeliverySlot | None = None) -> bool:
        """Renew, deliver, record; True only when the row was delivered.

        A failure is recorded but is not progress: a batch that failed in full must not make
        the loop re-poll at once (it would sweep the backlog charging every row a retry while
        the cause, usually a dependency outage, is still there).
        """
        if self._needs_renewal(row) and not await self.outcomes.renew(row, token):
            self.outcomes.lost(row, "before dispatch")
            return False
        attributes: dict[str, AttributeValue] = {
            "messaging.message.id": str(row.id),
            f"{self.name}.retry_count": row.retry_count,
        }
        with self._tracing.span(
            f"{self.name} deliver {row.name}",
            kind=self._deliverer.span_kind(row),
            traceparent=row.trace_context,
            attributes=attributes,
        ) as span:
            # The delivery runs under this span: a published message carries it on (a copy of the
            # row only when the span has a traceparent of its own: not with tracing off).
            if span.traceparent != row.trace_context:
                row = dataclasses.replace(row, trace_context=span.traceparent)
            return await self._deliver(row, token, span, slot)

    def _needs_renewal(self, row: ClaimedRow) -> bool:
        """A row whose delivery runs handlers gets a whole lease first (the ADR's renewal). A
        publish renews only when the lease left might not outlast the delivery's time limit plus
        the margin (a slow batch, or a process that was frozen: the renewal is then what finds
        the lease lost). That saves a transaction per published row while the claim is young;
        and as every delivery ends by its limit, none outlives its lease: no replica can claim
        a row while it is in flight here. The stamp stays token-guarded either way."""
        return self._deliverer.needs_fresh_lease(row) or self.outcomes.lease_is_short(row)

    async def _deliver(
        self, row: ClaimedRow, token: uuid.UUID, span: Span, slot: DeliverySlot | None
    ) -> bool:
        write = self._shutdown.write
        # The deliverer puts the limit around the handlers or the publish only: past the stamp,
        # a delivery cannot fail (its follow-on deliveries have limits of their own).
        limit = functools.partial(time_limit, self.settings.delivery_timeout_seconds, "delivery")
        try:
            delivered = await self._deliverer.deliver(row, token, limit)
        except LeaseLostError:
            self.outcomes.lost(row, "while its handlers ran (their effects were rolled back)")
            return False
        except PausedError as paused:
            span.set_attribute("outcome", "paused")
            await write(self.outcomes.pause(row, token, paused.retry_at, str(paused)))
            return False
        except Exception as error:  # noqa: BLE001 (every failure is recorded on the row)
            span.record_failure(error)
            if is_database_outage(error):
                await self._database_outage(row, token, error)
            else:
                await write(self.outcomes.fail(row, token, error))
            return False
        if isinstance(delivered, Unrouted):
            return await write(self.outcomes.stamp_unrouted(row, token, delivered.detail))
        if delivered is Delivered.NEEDS_STAMP:
            if slot is not None:
                slot.free()  # the next row may publish while this one waits for its stamp group
            return await write(self.outcomes.stamp(row, token))
        self.outcomes.delivered(row)
        return True

    async def _database_outage(self, row: ClaimedRow, token: uuid.UUID, error: BaseException) -> None:
        """The handler's unit of work could not reach the database: not the row's fault, so no
        retry is charged. The row is released for the next cycle; if even that cannot be
        written, its lease runs out and it returns the same way."""
        log.warning(
            "%s row %s (%s): database unreachable during delivery, not charged: %s",
            *(self.name, row.id, row.name, error),
        )
        note = f"database unreachable: {type(error).__name__}: {error}"
        try:
            await self._shutdown.write(self.outcomes.pause(row, token, None, note))
        except Exception:
            log.debug("%s row %s: release failed as well", self.name, row.id, exc_info=True)

    # -- smart wait ------------------------------------------------------------------------

    async def next_due(self) -> datetime | None:
        """The earliest moment a pending row the last claim could not take becomes claimable.

        The bound is the moment of the last claim, not "now": a backoff or delay that ran out
        while a slow cycle was delivering was not seen by that claim, so the row is due at once
        (a lower bound of "now" would miss it and the loop would sleep the whole fallback
        interval). A row the claim saw and left (leased elsewhere, or waiting) is due only at
        its own time, so it cannot make the loop spin.
        """
        seen_until = self._last_claim_at or self._clock()
        t = self.table.c
        pending = sa.and_(t.processed_on.is_(None), t.dead_lettered_on.is_(None))
        leased = sa.select(sa.func.min(t.locked_until)).where(pending, t.locked_until > seen_until)
        waiting = sa.select(sa.func.min(t.available_on)).where(
            pending, t.locked_until.is_(None), t.available_on > seen_until
        )
        both = sa.select(leased.scalar_subquery(), waiting.scalar_subquery())  # one round trip
        async with self.database.bookkeeping_statement() as connection:
            first, second = (await connection.execute(both)).one()
        candidates = [d for d in (first, second) if d is not None]
        return min(candidates) if candidates else None
