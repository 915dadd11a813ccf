"""In-process delivery: the domain-event rows a commit leased to this process, delivered right
after it, and the cascade limit.

Cascades past ``OUTBOX__MAX_CASCADE_DEPTH`` (handlers raising events whose handlers raise
events...) are dead-lettered with the reason ``cascade_depth_exceeded`` and an Error log naming
the rows: handing them to the processor would only restart the count (it delivers at depth 1),
so an event loop A -> B -> A would never end. A dead letter is evidence an operator can read and
replay once the loop is fixed; the rows committed so far stay committed.

The leases of rows a commit inserted already leased to this process, as in-process dispatch
keeps them: renewed just before each row's handlers run (a lost one raises ``LeaseLostError``),
and given back (uncharged) when the row cannot be delivered here, with a PostgreSQL NOTIFY in the
releasing transaction so a worker in another process retries it after the processing delay,
not at its fallback poll. A release is best effort: a failed one is logged and the rows wait out
their lease. At shutdown the release is protected from the cancellation and bounded by the
shutdown timeout.

In-process delivery of local domain events: right after commit, and for the processor.

Each event is delivered in its own follow-up unit of work: every handler of the event runs in it,
then the row's processed stamp is added under the row's lock token and the unit of work commits
handler effects, any events they raised and the stamp together. If the token no longer matches
(another processor took the row), the whole follow-up rolls back: the new owner delivers.

After a commit, rows are delivered one at a time, in ``seq`` order; then the rows their
deliveries' commits leased, a generation after the other (a follow-up unit of work leaves them
to the delivery that opened it: no unit of work dispatches from inside another's delivery, and
the cascade's depth is the generation). So a row an event's handler raises on its own aggregate
comes after the rest of its commit's rows of that key, as its ``seq`` does. The lease a row was inserted
under only keeps other replicas away while it lasts, and an earlier row's handlers may outlast
it; so each row's lease is renewed under its token just before its handlers run, and a row whose
token is gone (a replica claimed it meanwhile) is skipped: its new owner delivers it.

Each dispatch's handlers run under ``OUTBOX__DELIVERY_TIMEOUT_SECONDS`` (after the renewal, so the
lease outlasts it); past it they are cancelled and the delivery fails. The limit does not cover
the commit: it stamps the row and then delivers the events the handlers raised, each under a
limit of its own, and a delivery whose row is stamped must not be reported failed.
A failed delivery releases the row's lease under its token, so the processor retries it once the
processing delay has passed (:class:`InProcessRowLeases`: with a NOTIFY, best effort); later rows of the same
ordering key are released untouched so they are not delivered before it. A keyed row that still
has an earlier pending row of its key (written by another transaction) is left to the processor,
whose claim enforces the order. A shutdown that interrupts the dispatch gives the rows not yet
finished back the same way, so they do not wait out their lease. Cascades past
``OUTBOX__MAX_CASCADE_DEPTH`` are dead-lettered (:func:`dead_letter_cascade`)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from datetime import datetime, timedelta
from itertools import groupby
from typing import TYPE_CHECKING

import sqlalchemy as sa

from outbox_kit.application.clock import Clock, TimeLimit, time_limit
from outbox_kit.application.handlers import HandlerRegistry, handler_name
from outbox_kit.application.messages import IntegrationEvent
from outbox_kit.domain import Message
from outbox_kit.persistence.database import Database
from outbox_kit.persistence.save_guard import handler_scope
from outbox_kit.persistence.tables import CASCADE_DEPTH_EXCEEDED, OUTBOX_TABLE, LeaseLostError, LeaseStore
from outbox_kit.persistence.unit_of_work import Committed, SqlUnitOfWorkFactory
from outbox_kit.persistence.writer import WrittenRow, wake_replicas
from outbox_kit.processor.cycle import CycleShutdown

if TYPE_CHECKING:
    from outbox_kit.application.metrics import RelayMetrics


log = logging.getLogger(__name__)


class CascadeDepthError(RuntimeError):
    """Domain events kept raising domain events past the configured depth."""


async def dead_letter_cascade(
    *,
    database: Database,
    clock: Clock,
    store: LeaseStore,
    rows: Sequence[WrittenRow],
    max_depth: int,
    metrics: RelayMetrics | None,
) -> None:
    names = ", ".join(sorted({row.message.message_name for row in rows}))
    error = CascadeDepthError(
        f"domain events cascaded past depth {max_depth} (OUTBOX__MAX_CASCADE_DEPTH): a handler "
        f"chain keeps raising events; {len(rows)} row(s) of {names} dead-lettered"
    )
    log.error("%s (rows %s)", error, ", ".join(str(row.id) for row in rows))
    now = clock()
    try:
        async with database.bookkeeping() as connection:
            for row in rows:
                await store.record_failure(
                    connection,
                    row.id,
                    row.lock_token,
                    now=now,
                    error=repr(error),
                    retry_count=0,
                    retry_at=now,
                    dead_letter_reason=CASCADE_DEPTH_EXCEEDED,
                )
    except Exception:
        # Best effort, like a release: the rows then wait out their lease for the processor.
        log.exception("could not dead-letter %s outbox row(s) past the cascade depth", len(rows))
        return
    if metrics is not None:
        metrics.dead_lettered("outbox", CASCADE_DEPTH_EXCEEDED, len(rows))


class InProcessRowLeases:
    """Renewals, releases and the key check of in-process outbox rows."""

    def __init__(
        self,
        *,
        database: Database,
        clock: Clock,
        wake: Callable[[], None],
        lease_seconds: float,
        notify_channel: str,
        shutdown_timeout_seconds: float,
    ) -> None:
        self._db = database
        self._clock = clock
        self._wake = wake
        self._lease = timedelta(seconds=lease_seconds)
        self._channel = notify_channel
        self._shutdown_timeout = shutdown_timeout_seconds
        self.store = LeaseStore(OUTBOX_TABLE)

    async def renew(self, row: WrittenRow) -> None:
        """Give the row a whole lease for its own delivery (``LeaseLostError``: no longer ours)."""
        until = self._clock() + self._lease
        async with self._db.bookkeeping() as connection:
            if row.id not in await self.store.renew(connection, [row.id], row.lock_token, until):
                msg = f"outbox row {row.id} is no longer leased to this process"
                raise LeaseLostError(msg)

    async def has_earlier_pending(self, row: WrittenRow) -> bool:
        table = OUTBOX_TABLE
        statement = (
            sa.select(sa.literal(1))
            .where(
                table.c.ordering_key == row.ordering_key,
                table.c.seq < row.seq,
                table.c.processed_on.is_(None),
                table.c.dead_lettered_on.is_(None),
            )
            .limit(1)
        )
        async with self._db.bookkeeping() as connection:
            result = await connection.execute(statement)
            return result.first() is not None

    async def release(self, rows: Sequence[WrittenRow], error: BaseException | None) -> None:
        """Give rows back to the processor (uncharged) and wake every replica's processor."""
        note = None if error is None else repr(error)
        try:
            async with self._db.bookkeeping() as connection:
                for token, group in groupby(rows, key=lambda row: row.lock_token):
                    await self.store.release(connection, [row.id for row in group], token, error=note)
                if self._db.is_postgresql:
                    await connection.execute(wake_replicas(self._channel))
            self._wake()
        except Exception:
            # Best effort: the rows then wait out their lease (OUTBOX__LEASE_SECONDS).
            log.exception("could not release the lease of %s outbox row(s)", len(rows))

    async def commit_leased(self, commit: Awaitable[None], token: uuid.UUID, lease_until: datetime) -> None:
        """The commit that inserts rows leased under ``token``: a cancellation that interrupts it
        gives them back by token and lease end, as a cycle's interrupted claim does (its ids
        are as unknown: the COMMIT may have landed unheard)."""
        shutdown = CycleShutdown(
            name="in-process dispatch",
            timeout_seconds=self._shutdown_timeout,
            database=self._db,
            leases=self.store,
        )
        try:
            await shutdown.claim(commit, token, lease_until)
        except asyncio.CancelledError:
            self._wake()  # this process's processor; other replicas find them at their poll
            raise

    async def release_on_shutdown(self, rows: Sequence[WrittenRow]) -> None:
        """The release, protected from the cancellation that is stopping the process and bounded
        by the shutdown timeout."""
        release = asyncio.ensure_future(self.release(rows, None))
        try:
            await asyncio.wait_for(asyncio.shield(release), self._shutdown_timeout)
        except TimeoutError:
            log.warning(
                "shutdown: %s in-process row(s) not released in time; they wait out their lease", len(rows)
            )


DirectPublish = Callable[[IntegrationEvent], Awaitable[None]]


class LocalDispatcher:
    """Runs domain-event handlers in follow-up units of work: the ``AfterCommit`` of every
    unit-of-work factory of its source, and the processor's delivery of a domain-event row.

    It holds no factory: each call names the one whose commit it follows, and the follow-up
    units of work come from it. A follow-up does not dispatch what its own commit leased; it
    leaves that (``SqlUnitOfWork.left``) to the dispatch that opened it, which delivers it next,
    one generation after the other (:meth:`_drain`). So a cascade is a queue here, not a
    recursion through the unit of work, and its depth is the generation the queue counts.
    """

    def __init__(
        self,
        handlers: HandlerRegistry,
        *,
        database: Database,
        clock: Clock,
        wake: Callable[[], None],
        max_cascade_depth: int,
        lease_seconds: float,
        delivery_timeout_seconds: float,
        notify_channel: str,
        shutdown_timeout_seconds: float,
        publish_direct: DirectPublish | None = None,
        metrics: RelayMetrics | None = None,
    ) -> None:
        self._handlers = handlers
        self._db = database
        self._clock = clock
        self._metrics = metrics
        self._max_depth = max_cascade_depth
        self._delivery_timeout = delivery_timeout_seconds
        self._leases = InProcessRowLeases(
            database=database,
            clock=clock,
            wake=wake,
            lease_seconds=lease_seconds,
            notify_channel=notify_channel,
            shutdown_timeout_seconds=shutdown_timeout_seconds,
        )
        self._publish_direct = publish_direct

    async def commit_leased(self, commit: Awaitable[None], token: uuid.UUID, lease_until: datetime) -> None:
        """Run a commit that inserts rows leased to this process (see :class:`AfterCommit`)."""
        await self._leases.commit_leased(commit, token, lease_until)

    async def dispatch(self, committed: Committed, units: SqlUnitOfWorkFactory) -> None:
        """Deliver what a commit of ``units`` left to this process, and the cascade that follows
        (never raises but on shutdown: the commit stands)."""
        if committed.rows:
            await self._drain(units, committed.rows, generation=0)
        elif committed.events or committed.integration_events:
            await self._dispatch_without_outbox(units, committed)

    async def deliver(
        self,
        units: SqlUnitOfWorkFactory,
        message: Message,
        *,
        row_id: uuid.UUID,
        token: uuid.UUID,
        limit: TimeLimit,
    ) -> None:
        """The processor's delivery of one domain-event row: every handler of ``message`` within
        ``limit``, their effects committed with the row's stamp; then, outside the limit, the
        rows that commit leased (a stamped row's delivery must not be reported failed)."""
        left = await self._follow_up(units, message, row_id=row_id, token=token, limit=limit)
        await self._drain(units, left.rows, generation=1)

    async def _follow_up(
        self,
        units: SqlUnitOfWorkFactory,
        message: Message,
        *,
        row_id: uuid.UUID | None,
        token: uuid.UUID | None,
        limit: TimeLimit,
    ) -> Committed:
        """Run every handler of ``message`` within ``limit`` in a follow-up unit of work, and
        commit their effects with the row's stamp; what that commit left, to deliver next."""
        uow = units.follow_up()
        try:
            async with uow:
                async with limit():
                    for handler in self._handlers.domain_handlers(type(message)):
                        with handler_scope(handler_name(handler)):
                            await handler(message, uow)
                if row_id is not None and token is not None:
                    uow.stamp_processed_on_commit(self._leases.store, row_id, token)
                await uow.commit()
        except BaseException:
            if uow.left is not None and uow.left.rows:  # committed, and now nobody delivers them
                await self._leases.release_on_shutdown(uow.left.rows)
            raise
        return uow.left or Committed()

    def _time_limit(self) -> AbstractAsyncContextManager[None]:
        """The dispatches this dispatcher starts itself get the delivery's time limit (the
        processor hands its own to ``deliver``): a handler that never returns must not hold
        the commit that wrote its row, nor the request behind it."""
        return time_limit(self._delivery_timeout, "delivery")

    async def _drain(self, units: SqlUnitOfWorkFactory, rows: Sequence[WrittenRow], generation: int) -> None:
        """Deliver ``rows`` (leased by a commit ``generation`` deliveries deep), then the rows
        each delivery's commit leased, a generation after the other: so every row of a commit
        is delivered before any row its deliveries raised, and rows of one key keep ``seq``
        order. A generation at ``OUTBOX__MAX_CASCADE_DEPTH`` is a loop: dead-lettered. A
        cancellation gives back every row not delivered yet (token-guarded: a stamped row no
        longer matches)."""
        queue = deque((row, generation) for row in rows)
        blocked_keys: set[str] = set()
        try:
            while queue:
                row, generation = queue[0]
                if generation >= self._max_depth:  # breadth first: every row still queued is as deep
                    await self._dead_letter([row for row, _ in queue])
                    return
                left = await self._dispatch_one(units, row, blocked_keys)
                queue.popleft()
                queue.extend((raised, generation + 1) for raised in left)
        except asyncio.CancelledError:
            await self._leases.release_on_shutdown([row for row, _ in queue])
            raise

    async def _dead_letter(self, rows: Sequence[WrittenRow]) -> None:
        await dead_letter_cascade(
            database=self._db,
            clock=self._clock,
            store=self._leases.store,
            rows=rows,
            max_depth=self._max_depth,
            metrics=self._metrics,
        )

    async def _dispatch_one(
        self, units: SqlUnitOfWorkFactory, row: WrittenRow, blocked_keys: set[str]
    ) -> Sequence[WrittenRow]:
        """Deliver one row, or hand it to the processor; later rows of a key that could not be
        delivered here are handed over too, so they never overtake it. The rows its delivery
        leased, to deliver next."""
        key = row.ordering_key
        if key is not None and key in blocked_keys:
            await self._leases.release([row], None)
            return ()
        try:
            if key is not None and await self._leases.has_earlier_pending(row):
                blocked_keys.add(key)
                await self._leases.release([row], None)
                return ()
            await self._leases.renew(row)
            left = await self._follow_up(
                units, row.message, row_id=row.id, token=row.lock_token, limit=self._time_limit
            )
        except LeaseLostError:
            if key is not None:
                blocked_keys.add(key)
            log.warning(
                "outbox row %s (%s) was claimed by another processor before or during its in-process "
                "dispatch; it was not delivered here (effects rolled back) and the new owner delivers it",
                row.id,
                row.message.message_name,
            )
        except Exception as error:  # noqa: BLE001 (any handler failure goes back to the outbox)
            log.warning(
                "in-process dispatch of %s (outbox row %s) failed; the processor will retry: %r",
                row.message.message_name,
                row.id,
                error,
            )
            if key is not None:
                blocked_keys.add(key)
            await self._leases.release([row], error)
        else:
            return left.rows
        return ()

    async def _dispatch_without_outbox(self, units: SqlUnitOfWorkFactory, committed: Committed) -> None:
        """Outbox off (in-process transport only): deliver and publish directly, best effort,
        the cascade a generation after the other as with rows."""
        queue = deque([(committed, 0)])
        while queue:
            done, generation = queue.popleft()
            for event in done.events:
                if generation >= self._max_depth:
                    log.error("domain events cascaded past depth %s; %s dropped", self._max_depth, event)
                    continue
                try:
                    left = await self._follow_up(
                        units, event, row_id=None, token=None, limit=self._time_limit
                    )
                except Exception:
                    log.exception("direct dispatch of %s failed (outbox disabled)", event.message_name)
                else:
                    queue.append((left, generation + 1))
            for integration_event in done.integration_events:
                await self._publish(integration_event)

    async def _publish(self, integration_event: IntegrationEvent) -> None:
        if self._publish_direct is None:
            log.error("no direct publisher bound; %s dropped", integration_event.message_name)
            return
        try:
            await self._publish_direct(integration_event)
        except Exception:
            log.exception("direct publish of %s failed (outbox disabled)", integration_event.message_name)
