"""One table drained by one processor: claim a batch, then renew -> deliver -> record per row.

(The renewal is skipped for a publish while the claim's lease outlasts the delivery's time
limit, and the stamps of rows that finish together share one statement: see ``_needs_renewal``
and ``stamps``.) Every delivery runs under ``OUTBOX__DELIVERY_TIMEOUT_SECONDS``: one that never
returns is cancelled and charged like any failure, so it holds its own row only, never the cycle.

This is the per-row half of the shared polling core; what "deliver" means is the only thing
the outbox and the internal-command processors do differently (a ``Deliverer``). Each row's
outcome is written as soon as it finishes (``outcomes``); a stop in the middle of a cycle is
``shutdown``'s business; the claim statement is ``claim``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import random
import uuid
from datetime import datetime

import sqlalchemy as sa

from ..kernel.clock import Clock
from ..kernel.no_tracing import NoTracing
from ..kernel.time_limits import time_limit
from ..kernel.tracing import AttributeValue, Span, Tracing
from ..persistence.database import Database
from ..persistence.outages import is_database_outage
from .claim import Claimer
from .claimed import ClaimedRow
from .leases import LeaseLostError, LeaseStore, lease_until
from .loop import CycleResult
from .outcomes import Outcomes
from .ports import CycleMetrics, Deliverer, SourceSettings
from .results import Delivered, PausedError
from .shutdown import CycleShutdown
from .slots import DeliverySlot

log = logging.getLogger(__name__)


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
        metrics: CycleMetrics,
        rng: random.Random | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.name = name
        self.table = table
        self.settings = settings
        self._db = database
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
            database=self._db,
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
        async with self._db.bookkeeping() as connection:
            rows = await self._claimer.claim(
                connection, now=now, lease_until=until, token=token, locked_by=self._instance_id
            )
        # The claim's own rows give the backlog age: no MIN() query.
        age = (now - min(row.occurred_on for row in rows)).total_seconds() if rows else 0.0
        self._metrics.backlog_age(self.name, max(age, 0.0))
        return rows

    async def run_cycle(self) -> CycleResult:
        """Claim a batch and deliver it, up to ``delivery_concurrency`` rows at a time.

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
        gate = asyncio.Semaphore(self.settings.delivery_concurrency)
        # Handlers each hold a database session: no more at once than the pool has connections.
        handlers = asyncio.Semaphore(min(self.settings.delivery_concurrency, self._db.settings.pool_size))
        started: set[uuid.UUID] = set()

        async def process(row: ClaimedRow) -> bool:
            room = handlers if self._deliverer.needs_fresh_lease(row) else contextlib.nullcontext()
            async with room, DeliverySlot(gate) as slot:  # a row waiting for room holds no slot
                started.add(row.id)
                return await self._process(row, token, slot)

        tasks = [asyncio.ensure_future(process(row)) for row in rows]
        if tasks:
            try:
                await asyncio.wait(tasks)  # not gather: a cancelled gather waits for its children
            except asyncio.CancelledError:
                await self._shutdown.stop(tasks, rows, started, token)
                await self.outcomes.stamps.settle(self._shutdown.deadline())
                raise
        return self._result(rows, tasks)

    def _result(self, rows: list[ClaimedRow], tasks: list[asyncio.Task[bool]]) -> CycleResult:
        errors = [error for task in tasks if (error := task.exception()) is not None]
        for extra in errors[1:]:
            log.error("%s: another delivery of the cycle failed too", self.name, exc_info=extra)
        if errors:
            raise errors[0]
        done = [task.result() is True for task in tasks]
        self._metrics.beat(self.name, self._clock())
        if rows:
            log.debug("%s: claimed %s, completed %s", self.name, len(rows), sum(done))
        return CycleResult(
            claimed=len(rows),
            completed=sum(done),
            full_batch=len(rows) >= self.settings.batch_size,
            keyed_completed=any(
                ok and row.ordering_key is not None for row, ok in zip(rows, done, strict=True)
            ),
        )

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
            # The delivery runs under this span: a published message carries it on.
            traced = dataclasses.replace(row, trace_context=span.traceparent)
            return await self._deliver(traced, token, span, slot)

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
        async with self._db.bookkeeping_statement() as connection:
            first, second = (await connection.execute(both)).one()
        candidates = [d for d in (first, second) if d is not None]
        return min(candidates) if candidates else None
