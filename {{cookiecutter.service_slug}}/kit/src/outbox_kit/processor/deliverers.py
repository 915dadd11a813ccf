"""The two deliverers the processor core runs: the outbox's (publish through the message bus, or
dispatch in-process) and the internal commands' (run the command's handler).

**The outbox's deliverer**, with one claimed row:

* Local domain-event rows: the row's context is restored on a fresh scope (tenant, user, roles
  with authentication type ``outbox``, correlation), the handlers run in a fresh unit of work,
  and their effects and the processed stamp commit together (see ``dispatch``). A local event
  with no handler on this host is stamped processed with a Warning, once per event name: the
  handler probably lives on another host, which must then run this processor instead
  (``OUTBOX__IMMEDIATE_DISPATCH=false`` on producer-only hosts: a host that writes local events
  it does not handle leaves them to the host that does). An event declared
  ``handlers.record_only(...)`` is stamped quietly: it has no handler by design.
* Integration-event rows: published through the message bus behind the circuit breaker; the
  processed stamp is written only after the transport confirmed the publish. A publish no
  consumer was bound to take comes back :class:`Unrouted`: a delivery to nobody, stamped too.
  The body is the row's stored payload as canonical JSON (``transports.envelope.body_of``),
  never re-encoded through the event's current class, so every copy of one row is byte-identical.

**The internal commands' deliverer.** An internal command is a deferred instruction to this
service itself: ``uow.schedule(command, due_at)`` writes an ``internal_commands`` row in the caller's
transaction, with the same context capture as an outbox row. The internal-command processor
(the same polling core, lease, backoff and dead-letter idiom as the outbox) runs the command's
handler in a fresh unit of work under the restored context, and stamps the row processed in
that same transaction: the command's effects happen exactly once."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence

from outbox_kit.application.clock import TimeLimit, TimeLimitExceededError
from outbox_kit.application.context import restored
from outbox_kit.application.handlers import HandlerRegistry, handler_name
from outbox_kit.application.messages import MessageRegistry, Payload
from outbox_kit.application.tracing import SpanKind
from outbox_kit.domain import Message
from outbox_kit.persistence.save_guard import handler_scope
from outbox_kit.persistence.tables import COMMAND_TABLE, DOMAIN, LeaseStore
from outbox_kit.persistence.unit_of_work import SqlUnitOfWorkFactory
from outbox_kit.processor.claim import ClaimedRow
from outbox_kit.processor.in_process import LocalDispatcher
from outbox_kit.processor.processor import RowByRow
from outbox_kit.transports.bus import (
    CircuitBreaker,
    Delivered,
    MessageBus,
    PausedError,
    PublishResult,
    Unrouted,
)
from outbox_kit.transports.envelope import Envelope, body_of
from outbox_kit.transports.settings import Transport

log = logging.getLogger(__name__)
OUTBOX_AUTHENTICATION = "outbox"


class OutboxDeliverer:
    """Delivers outbox rows: in-process for domain events, through the bus for integration."""

    def __init__(
        self,
        *,
        registry: MessageRegistry,
        handlers: HandlerRegistry,
        dispatcher: LocalDispatcher,
        units: SqlUnitOfWorkFactory,
        bus: MessageBus,
        breaker: CircuitBreaker,
    ) -> None:
        self._registry = registry
        self._handlers = handlers
        self._dispatcher = dispatcher
        self._units = units
        self._bus = bus
        self._breaker = breaker
        self._warned: set[str] = set()

    def needs_fresh_lease(self, row: ClaimedRow) -> bool:
        """Local handlers get a whole lease first (and hold a database session); a publish renews
        only when its lease might not outlast the delivery's time limit."""
        return row.kind == DOMAIN

    def span_kind(self, row: ClaimedRow) -> SpanKind:
        """A publish is a producer span; a local delivery stays inside this service."""
        return SpanKind.INTERNAL if row.kind == DOMAIN else SpanKind.PRODUCER

    def publishes(self, row: ClaimedRow) -> bool:
        """Integration events go to a broker in batches. Domain events run local handlers, and
        so do integration events on the in-process transport (its consumers run in this
        process): those are delivered row by row, each under its own time limit."""
        return row.kind != DOMAIN and self._bus.name != Transport.INPROCESS

    async def deliver(self, row: ClaimedRow, token: uuid.UUID, limit: TimeLimit) -> Delivered | Unrouted:
        with restored(row.captured_context(), authentication_type=OUTBOX_AUTHENTICATION):
            if row.kind != DOMAIN:  # a batch of one, under the row's context (its lines logged)
                (outcome,) = await self.deliver_published([row], 1, limit)
                if isinstance(outcome, BaseException):
                    raise outcome
                return outcome
            message, _ = self._loaded(row)
            if not self._handlers.has_domain_handlers(type(message)):
                if not self._handlers.is_record_only(type(message)):
                    self._warn_no_handler(row.name)
                return Delivered.NEEDS_STAMP
            await self._dispatcher.deliver(self._units, message, row_id=row.id, token=token, limit=limit)
            return Delivered.STAMPED

    async def deliver_published(
        self, rows: Sequence[ClaimedRow], window: int, limit: TimeLimit
    ) -> list[Delivered | Unrouted | BaseException]:
        """Publish integration-event rows together behind the circuit breaker, all under one
        delivery time limit; each row's outcome in order (an error is the row's, never raised):
        ``NEEDS_STAMP`` once the broker confirmed it, :class:`Unrouted`, or the error (a
        :class:`CircuitOpenError` pause for an outage; the time limit's error for every row still
        unconfirmed when it ran out)."""
        outcomes: list[Delivered | Unrouted | BaseException] = []
        envelopes: list[Envelope] = []
        for row in rows:
            try:
                envelopes.append(self._envelope(row))
                outcomes.append(Delivered.NEEDS_STAMP)
            except Exception as error:  # noqa: BLE001 (a row that cannot be read fails alone)
                outcomes.append(error)
        published = await self._publish(envelopes, window, limit)
        built = iter(published)
        return [
            outcome if isinstance(outcome, BaseException) else (next(built) or outcome)
            for outcome in outcomes
        ]

    async def _publish(self, envelopes: list[Envelope], window: int, limit: TimeLimit) -> list[PublishResult]:
        if not envelopes:
            return []
        try:
            async with limit():
                return await self._breaker.call(lambda: self._bus.publish_batch(envelopes, window))
        except PausedError as paused:  # the circuit is open: nothing was attempted
            return [paused] * len(envelopes)
        except TimeLimitExceededError as expired:
            return [expired] * len(envelopes)

    def _loaded(self, row: ClaimedRow) -> tuple[Message, Payload]:
        """The row's message and its payload as stored (upcast when its name is an old
        version's): what is published, byte for byte on every publish of the row; the class
        only checks it and names it."""
        name, payload = self._registry.upcast(row.name, row.payload)
        return self._registry.load(name, payload), payload

    def _envelope(self, row: ClaimedRow) -> Envelope:
        message, payload = self._loaded(row)
        return Envelope(
            message_id=str(row.id),
            event_name=message.message_name,
            occurred_on=row.occurred_on,
            body=body_of(payload),
            context=row.captured_context(),
            ordering_key=message.ordering_key(),  # the plain key (the row's is per kind)
        )

    def _warn_no_handler(self, event_name: str) -> None:
        if event_name in self._warned:
            return
        self._warned.add(event_name)
        log.warning(
            "Outbox processor drained %s but no handler for it is registered on this host; the "
            "row is marked processed and not delivered. Register the handler on the processor "
            "host, run producer-only hosts with OUTBOX__IMMEDIATE_DISPATCH=false, or declare it "
            "handlers.record_only(...) if it is kept as a record only.",
            event_name,
        )


COMMAND_AUTHENTICATION = "internal-command"


class NoCommandHandlerError(LookupError):
    """A command was scheduled but no handler is registered for it on this host."""


class CommandDeliverer(RowByRow):
    """Runs one internal command in its own unit of work."""

    def __init__(
        self, *, registry: MessageRegistry, handlers: HandlerRegistry, units: SqlUnitOfWorkFactory
    ) -> None:
        self._registry = registry
        self._handlers = handlers
        self._units = units
        self._store = LeaseStore(COMMAND_TABLE)

    def needs_fresh_lease(self, row: ClaimedRow) -> bool:
        """A command's handler holds a database session: always a whole lease first."""
        del row
        return True

    def span_kind(self, row: ClaimedRow) -> SpanKind:
        del row
        return SpanKind.INTERNAL

    async def deliver(self, row: ClaimedRow, token: uuid.UUID, limit: TimeLimit) -> Delivered:
        command = self._registry.load(row.name, row.payload)
        handler = self._handlers.command_handler(type(command))
        if handler is None:
            msg = f"no handler is registered for internal command {row.name!r}"
            raise NoCommandHandlerError(msg)
        with restored(row.captured_context(), authentication_type=COMMAND_AUTHENTICATION):
            async with self._units() as uow:
                with handler_scope(handler_name(handler)):
                    async with limit():
                        await handler(command, uow)
                uow.stamp_processed_on_commit(self._store, row.id, token)
                await uow.commit()
        return Delivered.STAMPED
