"""The in-process transport: integration events delivered to this process's consumers.

It needs no server, so it is the embedded default. Every consumer of the event runs through the
same consume pipeline a broker delivery uses (signature, context restore, inbox); if one fails,
the others still run and the publish raises, so the outbox row is retried (the inbox skips the
consumers that already succeeded, when it is enabled). Each consumer's run is limited to
``MESSAGE_BUS__HANDLER_TIMEOUT_SECONDS``, as on a broker: one that hangs fails like any other
and the next consumer still runs, before the delivery's own (longer) limit ends the publish; and
without the outbox, the request that committed the event returns.

The raised :class:`ConsumerFailedError` is chained to a consumer's own error (``__cause__``): the
processor reads the chain to tell a database outage, which it releases the row for uncharged,
from a failure it charges as a retry. When several consumers failed, an outage is chosen as the
cause: the database was unreachable for this delivery, so no failure of it says anything about
the row yet (the next delivery, with the database back, charges a genuine failure).
"""

from __future__ import annotations

import logging

from ..application.handlers import HandlerRegistry
from ..application.registry import MessageRegistry, UnknownMessageError
from ..inbox.pipeline import ConsumePipeline
from ..kernel.time_limits import time_limit
from ..messaging.envelope import Envelope
from ..messaging.signing import Signer
from ..persistence.outages import is_database_outage

log = logging.getLogger(__name__)


class ConsumerFailedError(RuntimeError):
    """At least one in-process consumer failed; the outbox retries the message."""


class InProcessBus:
    """Delivers straight to the consume pipeline."""

    name = "inprocess"

    def __init__(
        self,
        *,
        handlers: HandlerRegistry,
        registry: MessageRegistry,
        pipeline: ConsumePipeline,
        signer: Signer,
        handler_timeout_seconds: float,
    ) -> None:
        self._handlers = handlers
        self._handler_timeout = handler_timeout_seconds
        self._registry = registry
        self._pipeline = pipeline
        self._signer = signer

    async def start(self) -> None:
        return None

    async def start_consuming(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def ping(self) -> None:
        return None

    async def publish(self, envelope: Envelope) -> None:
        event_type = self._registry.names.get(envelope.event_name)
        if event_type is None:
            msg = f"no registered message is named {envelope.event_name!r}"
            raise UnknownMessageError(msg)
        headers = self._signer.sign(envelope.headers(), envelope.body)
        failures: dict[str, Exception] = {}
        for consumer in self._handlers.consumers_of(event_type):
            try:
                async with time_limit(self._handler_timeout, "handler"):
                    await self._pipeline.consume(consumer, headers, envelope.body)
            except Exception as error:  # noqa: BLE001 (reported together below)
                log.warning("consumer %s failed on %s: %r", consumer.name, envelope.message_id, error)
                failures[consumer.name] = error
        if failures:
            errors = list(failures.values())
            cause = next((error for error in errors if is_database_outage(error)), errors[0])
            described = "; ".join(f"{name}: {type(e).__name__}: {e}" for name, e in failures.items())
            raise ConsumerFailedError(described) from cause
