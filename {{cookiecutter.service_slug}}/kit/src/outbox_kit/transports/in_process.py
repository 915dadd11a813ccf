"""The in-process transport: integration events delivered to this process's consumers.

It needs no server, so it is the embedded default. Every consumer of the event runs through the
same consume pipeline a broker delivery uses (signature, context restore, inbox); if one fails,
the others still run and the publish raises, so the outbox row is retried (the inbox skips the
consumers that already succeeded, when it is enabled). An event no consumer in the process
takes is :class:`~outbox_kit.transports.bus.Unrouted`, as on a broker with nothing bound.
Each consumer's handler is limited to ``MESSAGE_BUS__HANDLER_TIMEOUT_SECONDS`` (the pipeline's
limit, as on a broker; never its commit): one that hangs fails like any other and the next
consumer still runs, before the delivery's own (longer) limit ends the publish; and without the
outbox, the request that committed the event returns.

The raised :class:`ConsumerFailedError` is chained to a consumer's own error (``__cause__``): the
processor reads the chain to tell a database outage, which it releases the row for uncharged,
from a failure it charges as a retry. When several consumers failed, an outage is chosen as the
cause: the database was unreachable for this delivery, so no failure of it says anything about
the row yet (the next delivery, with the database back, charges a genuine failure)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from outbox_kit.application.handlers import Consumer, HandlerRegistry
from outbox_kit.application.messages import MessageRegistry, UnknownMessageError
from outbox_kit.transports.bus import PublishResult, Unrouted
from outbox_kit.transports.envelope import Envelope, Signer

log = logging.getLogger(__name__)

# What runs one consumer on a signed message: the consume pipeline (``consume/inbox.py``).
Consume = Callable[[Consumer[Any], Mapping[str, str], bytes], Awaitable[object]]


class ConsumerFailedError(RuntimeError):
    """At least one in-process consumer failed; the outbox retries the message."""


class InProcessBus:
    """Delivers straight to the consume pipeline. ``is_outage`` tells a failure that says the
    database was unreachable (the cause a failed delivery is reported with; see the module)."""

    name = "inprocess"

    def __init__(
        self,
        *,
        handlers: HandlerRegistry,
        registry: MessageRegistry,
        signer: Signer,
        consume: Consume,
        is_outage: Callable[[BaseException], bool],
    ) -> None:
        self._handlers = handlers
        self._registry = registry
        self._signer = signer
        self._consume = consume
        self._is_outage = is_outage

    async def start(self) -> None:
        return None

    async def start_consuming(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def ping(self) -> None:
        return None

    async def publish(self, envelope: Envelope) -> Unrouted | None:
        event_type = self._registry.names.get(envelope.event_name)
        if event_type is None:
            msg = f"no registered message is named {envelope.event_name!r}"
            raise UnknownMessageError(msg)
        consumers = self._handlers.consumers_of(event_type)
        if not consumers:
            return Unrouted(f"no consumer of {envelope.event_name} in this process; nothing was delivered")
        headers = self._signer.sign(envelope.headers(), envelope.body)
        failures: dict[str, Exception] = {}
        for consumer in consumers:
            try:
                await self._consume(consumer, headers, envelope.body)
            except Exception as error:  # noqa: BLE001 (reported together below)
                log.warning("consumer %s failed on %s: %r", consumer.name, envelope.message_id, error)
                failures[consumer.name] = error
        if failures:
            errors = list(failures.values())
            cause = next((error for error in errors if self._is_outage(error)), errors[0])
            described = "; ".join(f"{name}: {type(e).__name__}: {e}" for name, e in failures.items())
            raise ConsumerFailedError(described) from cause
        return None

    async def publish_batch(self, envelopes: Sequence[Envelope], window: int) -> list[PublishResult]:
        """One after another (the consumers run in this process): each message's outcome."""
        del window
        results: list[PublishResult] = []
        for envelope in envelopes:
            try:
                results.append(await self.publish(envelope))
            except Exception as error:  # noqa: BLE001 (the message's outcome, as on a broker)
                results.append(error)
        return results
