"""Internal commands: deferred instructions to this service itself.

``uow.schedule(command, due_at)`` writes an ``internal_commands`` row in the caller's
transaction, with the same context capture as an outbox row. The internal-command processor
(the same polling core, lease, backoff and dead-letter idiom as the outbox) runs the command's
handler in a fresh unit of work under the restored context, and stamps the row processed in
that same transaction: the command's effects happen exactly once."""

from __future__ import annotations

import uuid

from outbox_kit.application.context import restored
from outbox_kit.application.handlers import HandlerRegistry, handler_name
from outbox_kit.application.messages import MessageRegistry
from outbox_kit.application.observability import SpanKind
from outbox_kit.application.timing import TimeLimit
from outbox_kit.persistence.database import handler_scope
from outbox_kit.persistence.leases import LeaseStore
from outbox_kit.persistence.tables import COMMAND_TABLE
from outbox_kit.persistence.unit_of_work import SqlUnitOfWorkFactory
from outbox_kit.processor.claim import ClaimedRow
from outbox_kit.transports.bus import Delivered

COMMAND_AUTHENTICATION = "internal-command"


class NoCommandHandlerError(LookupError):
    """A command was scheduled but no handler is registered for it on this host."""


class CommandDeliverer:
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
