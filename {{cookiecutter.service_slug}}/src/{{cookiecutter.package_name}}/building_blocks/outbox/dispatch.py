"""In-process delivery of local domain events: right after commit, and for the processor.

Each event is delivered in its own follow-up unit of work: every handler of the event runs in it,
then the row's processed stamp is added under the row's lock token and the unit of work commits
handler effects, any events they raised and the stamp together. If the token no longer matches
(another processor took the row), the whole follow-up rolls back: the new owner delivers.

After a commit, a failed delivery releases the row's lease under its token (best effort, logged
on failure), so the processor retries it once the processing delay has passed; later rows of the
same ordering key are released untouched so they are not delivered before it. A keyed row that
still has an earlier pending row of its key (written by another transaction) is left to the
processor, whose claim enforces the order.

Cascades (handlers raising events whose handlers raise events...) are bounded by
``OUTBOX__MAX_CASCADE_DEPTH``. Past it the rows are dead-lettered with the reason
``cascade_depth_exceeded`` and an Error log names them: handing them to the processor instead
would only restart the count (the processor delivers at depth 1), so an event loop A -> B -> A
would never end. A dead letter is evidence an operator can read and replay once the loop is
fixed; the rows committed so far stay committed.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

import sqlalchemy as sa

from ..domain.events import DomainEvent, Message
from ..handlers import HandlerRegistry, handler_name
from ..messages import IntegrationEvent
from ..persistence.guard import handler_scope
from ..polling.leases import CASCADE_DEPTH_EXCEEDED, LeaseLostError, LeaseStore
from .capture import OUTBOX_TABLE, WrittenRow

if TYPE_CHECKING:
    import uuid

    from ..persistence.unit_of_work_factory import UnitOfWorkFactory
    from .metrics import OutboxMetrics

log = logging.getLogger(__name__)
DirectPublish = Callable[[IntegrationEvent], Awaitable[None]]


class CascadeDepthError(RuntimeError):
    """Domain events kept raising domain events past the configured depth."""


class LocalDispatcher:
    """Runs domain-event handlers in follow-up units of work."""

    def __init__(
        self,
        handlers: HandlerRegistry,
        *,
        max_cascade_depth: int,
        publish_direct: DirectPublish | None = None,
        metrics: OutboxMetrics | None = None,
    ) -> None:
        self._handlers = handlers
        self._metrics = metrics
        self._max_depth = max_cascade_depth
        self._store = LeaseStore(OUTBOX_TABLE)
        self._factory: UnitOfWorkFactory | None = None
        self._publish_direct = publish_direct

    def bind(self, factory: UnitOfWorkFactory) -> None:
        self._factory = factory

    @property
    def factory(self) -> UnitOfWorkFactory:
        if self._factory is None:
            msg = "LocalDispatcher is not bound to a UnitOfWorkFactory"
            raise RuntimeError(msg)
        return self._factory

    async def deliver(
        self, message: Message, *, row_id: uuid.UUID | None, token: uuid.UUID | None, depth: int
    ) -> None:
        """Run every handler of ``message`` and commit their effects with the row's stamp."""
        async with self.factory(depth=depth) as uow:
            for handler in self._handlers.domain_handlers(type(message)):
                with handler_scope(handler_name(handler)):
                    await handler(message, uow)
            if row_id is not None and token is not None:
                uow.stamp_processed_on_commit(self._store, row_id, token)
            await uow.commit()

    async def dispatch_committed(self, rows: Sequence[WrittenRow], *, depth: int) -> None:
        """Deliver the leased rows a commit just wrote (never raises: the commit stands)."""
        if not rows:
            return
        if depth >= self._max_depth:
            await self._dead_letter_cascade(rows)
            return
        blocked_keys: set[str] = set()
        for row in rows:
            if row.ordering_key is not None and row.ordering_key in blocked_keys:
                await self._release([row], None)
                continue
            try:
                if row.ordering_key is not None and await self._has_earlier_pending(row):
                    blocked_keys.add(row.ordering_key)
                    await self._release([row], None)
                    continue
                await self.deliver(row.message, row_id=row.id, token=row.lock_token, depth=depth + 1)
            except LeaseLostError:
                log.warning(
                    "outbox row %s (%s) was claimed by another processor during in-process "
                    "dispatch; its effects were rolled back and the new owner delivers it",
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
                if row.ordering_key is not None:
                    blocked_keys.add(row.ordering_key)
                await self._release([row], error)

    async def dispatch_without_outbox(
        self,
        events: Sequence[DomainEvent],
        integration_events: Sequence[IntegrationEvent],
        *,
        depth: int,
    ) -> None:
        """Outbox off (in-process transport, ADR-100): dispatch directly, best effort."""
        for event in events:
            if depth >= self._max_depth:
                log.error("domain events cascaded past depth %s; %s dropped", self._max_depth, event)
                continue
            try:
                await self.deliver(event, row_id=None, token=None, depth=depth + 1)
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

    async def _has_earlier_pending(self, row: WrittenRow) -> bool:
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
        async with self.factory.database.bookkeeping() as connection:
            result = await connection.execute(statement)
            return result.first() is not None

    async def _dead_letter_cascade(self, rows: Sequence[WrittenRow]) -> None:
        names = ", ".join(sorted({row.message.message_name for row in rows}))
        error = CascadeDepthError(
            f"domain events cascaded past depth {self._max_depth} (OUTBOX__MAX_CASCADE_DEPTH): a handler "
            f"chain keeps raising events; {len(rows)} row(s) of {names} dead-lettered"
        )
        log.error("%s (rows %s)", error, ", ".join(str(row.id) for row in rows))
        now = self.factory.clock()
        try:
            async with self.factory.database.bookkeeping() as connection:
                for row in rows:
                    await self._store.record_failure(
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
        if self._metrics is not None:
            self._metrics.dead_letters.labels("outbox", CASCADE_DEPTH_EXCEEDED).inc(len(rows))

    async def _release(self, rows: Sequence[WrittenRow], error: BaseException | None) -> None:
        try:
            async with self.factory.database.bookkeeping() as connection:
                for row in rows:
                    await self._store.release(
                        connection, [row.id], row.lock_token, error=None if error is None else repr(error)
                    )
            self.factory.wake()
        except Exception:
            # Best effort: the rows then wait out their lease (OUTBOX__LEASE_SECONDS).
            log.exception("could not release the lease of %s outbox row(s)", len(rows))
