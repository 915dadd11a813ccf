"""The message bus port: what a publish of an integration event ends in, the circuit breaker in
front of a broker, and publishing without the outbox.

**The port** (:class:`MessageBus`). Only the outbox processor publishes integration events
through it. A delivery ends delivered (stamped already, or needing the stamp) or paused because
its downstream is known to be down. A pause is not the row's fault: the row is released until
``retry_at`` without being charged a retry.

**A broker outage is not the message's fault.** A transport raises
:class:`BrokerUnavailableError` around its publish when it could not reach the broker (a lost
connection, a timeout, no servers). :class:`CircuitBreaker` counts only those, so an outage is
never recorded as one of the row's retries: the row is released until the breaker may close
(charging outages would dead-letter healthy messages during any outage longer than the retries).
After ``failure_threshold`` consecutive outages the circuit opens for ``reset_seconds`` and no
publish is attempted (:class:`CircuitOpenError`, a pause); then one trial is let through
(half-open): success closes it, an outage opens it again. A message-level failure (a refused
message, a consumer error on the in-process bus) passes through unchanged and is retried and
dead-lettered as usual; it also proves the broker is reachable, so it closes a half-open circuit.
An unrouted publish (no consumer bound yet) is no failure at all: it is a delivery to nobody
(:class:`Unrouted`).

**Without the outbox** (in-process transport, outbox off), a single-process host hands
integration events straight to the bus right after its commit: best effort, with no row to retry
from. Brokers never run this way: a broker transport with the outbox explicitly off is refused at
start-up."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import Enum
from typing import Protocol

from outbox_kit.application.clock import Clock
from outbox_kit.application.context import capture_context
from outbox_kit.application.messages import IntegrationEvent, MessageRegistry
from outbox_kit.domain import utc_now
from outbox_kit.transports.envelope import Envelope, body_of


class Delivered(Enum):
    """How a successful delivery left the row."""

    NEEDS_STAMP = "needs_stamp"  # e.g. a broker confirmed the publish
    STAMPED = "stamped"  # the handler's unit of work stamped it in its own transaction


@dataclass(frozen=True)
class Unrouted:
    """A publish the broker accepted although no consumer was bound to take it: a delivery to
    nobody. It succeeded (the publisher's contract exists before its first consumer), so the row
    is stamped processed, never retried or dead-lettered, and its ordering key moves on; the
    outbox records ``detail`` on the row (``explain`` says it), counts it and warns.

    ``detail`` says where the message went: kept where an operator can find it (RabbitMQ's
    ``<namespace>.unrouted`` queue), or kept in the stream or topic for the consumer that binds
    first (nothing lost), or nowhere (the in-process transport)."""

    detail: str


# What became of one message of a published batch: routed (None), unrouted, or the error its
# publish raised (an outage, or a refusal of that message alone).
PublishResult = Unrouted | None | BaseException


class PausedError(RuntimeError):
    """Not the row's fault: its downstream is down. Released until ``retry_at``, uncharged."""

    def __init__(self, message: str, retry_at: datetime) -> None:
        super().__init__(message)
        self.retry_at = retry_at


class CircuitOpenError(PausedError):
    """The broker is known to be down; the row is released until ``retry_at``, uncharged."""

    def __init__(self, retry_at: datetime) -> None:
        super().__init__(f"circuit open until {retry_at.isoformat()}", retry_at)


class BrokerUnavailableError(ConnectionError):
    """The broker could not be reached (raised by transports around their publish)."""


class MessageBus(Protocol):
    """A transport for integration events (in-process, RabbitMQ, Kafka, NATS or Redis)."""

    name: str

    async def start(self) -> None:
        """Connect and declare the topology (queues, streams, dead-letter destinations)."""
        ...

    async def start_consuming(self) -> None:
        """Begin delivering messages to this service's consumers (worker processes only)."""
        ...

    async def stop(self) -> None:
        """Stop consuming and disconnect."""
        ...

    async def publish(self, envelope: Envelope) -> Unrouted | None:
        """Hand one message to the transport; return only once it is durably accepted.

        :class:`Unrouted` when it was accepted with no consumer bound to take it (see there);
        None when it was routed to a consumer (or the transport cannot tell)."""
        ...

    async def publish_batch(self, envelopes: Sequence[Envelope], window: int) -> list[PublishResult]:
        """Hand every message to the transport together, up to ``window`` awaiting the broker's
        acknowledgement at once; return once each is durably accepted or failed, one result per
        envelope, in order (:class:`BrokerUnavailableError` for an outage). Never raises for a
        message: the caller records each outcome on its own row."""
        ...

    async def ping(self) -> None:
        """Raise unless the transport answers a round trip to the broker, not a flag of the client
        (used by /readyz, which bounds the wait)."""
        ...


class CircuitBreaker:
    """Consecutive-outage breaker with a half-open trial."""

    def __init__(self, *, failure_threshold: int, reset_seconds: float, clock: Clock) -> None:
        self._threshold = failure_threshold
        self._reset = timedelta(seconds=reset_seconds)
        self._clock = clock
        self._failures = 0
        self._open_until: datetime | None = None
        self._trial_running = False

    @property
    def state(self) -> str:
        if self._open_until is None:
            return "closed"
        return "open" if self._clock() < self._open_until else "half-open"

    def _retry_at(self) -> datetime:
        now = self._clock()
        if self._open_until is not None and self._open_until > now:
            return self._open_until
        # Below the threshold: step back a little, growing with the streak of outages.
        return now + min(self._reset, timedelta(seconds=self._failures))

    async def call(self, operation: Callable[[], Awaitable[list[PublishResult]]]) -> list[PublishResult]:
        """Run one publish attempt of a batch; raise :class:`CircuitOpenError` while the circuit is
        open (nothing is attempted). Each outage among the results counts as one failure and
        becomes :class:`CircuitOpenError` (a pause, uncharged); a batch with no outage proves the
        broker answered and closes the circuit."""
        state = self.state
        if state == "open" or (state == "half-open" and self._trial_running):
            raise CircuitOpenError(self._retry_at())
        self._trial_running = state == "half-open"
        try:
            results = await operation()
        finally:
            self._trial_running = False
        outages = sum(isinstance(result, BrokerUnavailableError) for result in results)
        if not outages:
            self._close()
            return results
        self._failures += outages  # each message's publish counts, as when they went one by one
        if self._failures >= self._threshold or state == "half-open":
            self._open_until = self._clock() + self._reset
        paused = CircuitOpenError(self._retry_at())
        return [self._paused(result, paused) for result in results]

    @staticmethod
    def _paused(result: PublishResult, paused: CircuitOpenError) -> PublishResult:
        if not isinstance(result, BrokerUnavailableError):
            return result
        pause = CircuitOpenError(paused.retry_at)
        pause.__cause__ = result
        return pause

    def _close(self) -> None:
        self._failures = 0
        self._open_until = None


class DirectPublisher:
    """Turns an integration event into an envelope under the ambient context and publishes it."""

    def __init__(self, bus: Callable[[], MessageBus], registry: MessageRegistry) -> None:
        self._bus = bus  # resolved on use: the bus is built after the unit-of-work machinery
        self._registry = registry

    async def __call__(self, event: IntegrationEvent) -> None:
        envelope = Envelope(
            message_id=str(uuid.uuid4()),
            event_name=event.message_name,
            occurred_on=getattr(event, "occurred_on", None) or utc_now(),
            body=body_of(self._registry.dump(event)),
            context=capture_context(),
            ordering_key=event.ordering_key(),
        )
        await self._bus().publish(envelope)
