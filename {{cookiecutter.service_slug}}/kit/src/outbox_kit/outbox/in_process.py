"""In-process delivery of local domain events: right after commit, and for the processor.

Each event is delivered in its own follow-up unit of work: every handler of the event runs in it,
then the row's processed stamp is added under the row's lock token and the unit of work commits
handler effects, any events they raised and the stamp together. If the token no longer matches
(another processor took the row), the whole follow-up rolls back: the new owner delivers.

After a commit, rows are delivered one at a time, in ``seq`` order. The lease a row was inserted
under only keeps other replicas away while it lasts, and an earlier row's handlers may outlast
it; so each row's lease is renewed under its token just before its handlers run, and a row whose
token is gone (a replica claimed it meanwhile) is skipped: its new owner delivers it.

Each dispatch's handlers run under ``OUTBOX__DELIVERY_TIMEOUT_SECONDS`` (after the renewal, so the
lease outlasts it); past it they are cancelled and the delivery fails. The limit does not cover
the commit: it stamps the row and then delivers the events the handlers raised, each under a
limit of its own, and a delivery whose row is stamped must not be reported failed.
A failed delivery releases the row's lease under its token, so the processor retries it once the
processing delay has passed (``row_leases``: with a NOTIFY, best effort); later rows of the same
ordering key are released untouched so they are not delivered before it. A keyed row that still
has an earlier pending row of its key (written by another transaction) is left to the processor,
whose claim enforces the order. A shutdown that interrupts the dispatch gives the rows not yet
finished back the same way, so they do not wait out their lease. Cascades past
``OUTBOX__MAX_CASCADE_DEPTH`` are dead-lettered (``cascade``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING

from ..application.handler_types import handler_name
from ..application.handlers import HandlerRegistry
from ..application.messages import IntegrationEvent
from ..domain.events import DomainEvent, Message
from ..kernel.time_limits import TimeLimit, time_limit
from ..persistence.handler_scope import handler_scope
from ..polling.leases import LeaseLostError
from ..unit_of_work.factory import UnitOfWorkFactory
from ..unit_of_work.rows import WrittenRow
from .cascade import dead_letter_cascade
from .row_leases import InProcessRowLeases

if TYPE_CHECKING:
    import uuid

    from ..kernel.metrics import RelayMetrics

log = logging.getLogger(__name__)
DirectPublish = Callable[[IntegrationEvent], Awaitable[None]]


class LocalDispatcher:
    """Runs domain-event handlers in follow-up units of work (the factory's ``AfterCommit``).

    ``units`` gives the factory when it is needed: the factory is built with this dispatcher,
    so neither holds the other at construction.
    """

    def __init__(
        self,
        handlers: HandlerRegistry,
        *,
        units: Callable[[], UnitOfWorkFactory],
        max_cascade_depth: int,
        lease_seconds: float,
        delivery_timeout_seconds: float,
        notify_channel: str,
        shutdown_timeout_seconds: float,
        publish_direct: DirectPublish | None = None,
        metrics: RelayMetrics | None = None,
    ) -> None:
        self._handlers = handlers
        self._metrics = metrics
        self._max_depth = max_cascade_depth
        self._delivery_timeout = delivery_timeout_seconds
        self._units = units
        self._leases = InProcessRowLeases(
            units=units,
            lease_seconds=lease_seconds,
            notify_channel=notify_channel,
            shutdown_timeout_seconds=shutdown_timeout_seconds,
        )
        self._publish_direct = publish_direct

    @property
    def factory(self) -> UnitOfWorkFactory:
        return self._units()

    async def deliver(
        self,
        message: Message,
        *,
        row_id: uuid.UUID | None,
        token: uuid.UUID | None,
        depth: int,
        limit: TimeLimit,
    ) -> None:
        """Run every handler of ``message`` within ``limit`` and commit their effects with the
        row's stamp (the commit, and the follow-on deliveries it runs, are not in ``limit``)."""
        async with self.factory(depth=depth) as uow:
            async with limit():
                for handler in self._handlers.domain_handlers(type(message)):
                    with handler_scope(handler_name(handler)):
                        await handler(message, uow)
            if row_id is not None and token is not None:
                uow.stamp_processed_on_commit(self._leases.store, row_id, token)
            await uow.commit()

    def _time_limit(self) -> AbstractAsyncContextManager[None]:
        """The dispatches this dispatcher starts itself get the delivery's time limit (the
        processor hands its own to ``deliver``): a handler that never returns must not hold
        the commit that wrote its row, nor the request behind it."""
        return time_limit(self._delivery_timeout, "delivery")

    async def dispatch_committed(self, rows: Sequence[WrittenRow], *, depth: int) -> None:
        """Deliver the leased rows a commit just wrote (never raises but on shutdown: the commit
        stands)."""
        if not rows:
            return
        if depth >= self._max_depth:
            await dead_letter_cascade(
                database=self.factory.database,
                clock=self.factory.clock,
                store=self._leases.store,
                rows=rows,
                max_depth=self._max_depth,
                metrics=self._metrics,
            )
            return
        blocked_keys: set[str] = set()
        try:
            for row in rows:
                await self._dispatch_one(row, blocked_keys, depth)
        except asyncio.CancelledError:
            # Token-guarded: rows already stamped no longer match, the rest are given back.
            await self._leases.release_on_shutdown(rows)
            raise

    async def _dispatch_one(self, row: WrittenRow, blocked_keys: set[str], depth: int) -> None:
        """Deliver one row, or hand it to the processor; later rows of a key that could not be
        delivered here are handed over too, so they never overtake it."""
        key = row.ordering_key
        if key is not None and key in blocked_keys:
            await self._leases.release([row], None)
            return
        try:
            if key is not None and await self._leases.has_earlier_pending(row):
                blocked_keys.add(key)
                await self._leases.release([row], None)
                return
            await self._leases.renew(row)
            await self.deliver(
                row.message, row_id=row.id, token=row.lock_token, depth=depth + 1, limit=self._time_limit
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

    async def dispatch_without_outbox(
        self,
        events: Sequence[DomainEvent],
        integration_events: Sequence[IntegrationEvent],
        *,
        depth: int,
    ) -> None:
        """Outbox off (in-process transport only): dispatch directly, best effort."""
        for event in events:
            if depth >= self._max_depth:
                log.error("domain events cascaded past depth %s; %s dropped", self._max_depth, event)
                continue
            try:
                await self.deliver(event, row_id=None, token=None, depth=depth + 1, limit=self._time_limit)
            except Exception:
                log.exception("direct dispatch of %s failed (outbox disabled)", event.message_name)
        for integration_event in integration_events:
            if self._publish_direct is None:
                log.error("no direct publisher bound; %s dropped", integration_event.message_name)
                continue
            try:
                await self._publish_direct(integration_event)
            except Exception:
                log.exception("direct publish of %s failed (outbox disabled)", integration_event.message_name)
