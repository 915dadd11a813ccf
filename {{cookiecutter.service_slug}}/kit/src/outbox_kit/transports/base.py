"""What the four broker transports share: the FastStream base (:class:`FastStreamTransport`, the
message bus port for a broker). What a transport receives is read by ``transports.received``,
and its dead-letter copies are fitted to the broker by ``transports.copies``.

Publishing: every transport signs the envelope, adds its CloudEvent headers, publishes within
``MESSAGE_BUS__PUBLISH_TIMEOUT_SECONDS`` (a batch pipelined on the broker's own acknowledgements)
and tells an outage (:class:`~outbox_kit.transports.bus.BrokerUnavailableError`, never charged to
the row) from a refusal of the message; a subclass only puts one signed message on its broker."""

from __future__ import annotations

import asyncio
import logging
import os
import time
import traceback
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from outbox_kit.application.handlers import Consumer
from outbox_kit.transports.bus import BrokerUnavailableError, PublishResult, Unrouted
from outbox_kit.transports.envelope import (
    Envelope,
    Signer,
    cloud_event_headers,
)
from outbox_kit.transports.settings import EndpointNames

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider
    from prometheus_client import CollectorRegistry

    from outbox_kit.transports.settings import MessageBusSettings

from faststream import BaseMiddleware
from faststream.prometheus.types import PublishingStatus

from outbox_kit.transports.copies import DeadLetterCopy
from outbox_kit.transports.received import DeliveryHandler, message_id_of

log = logging.getLogger(__name__)


# FastStream's own records (a subscriber waiting, a message that failed) go through the service's
# handler like every other record: FastStream's default logger paints ANSI colours even into a
# file, and it would bypass the escaping and credential masking of the service's log format.
BROKER_LOG = logging.getLogger(f"{__name__.rpartition('.')[0]}.faststream")


PER_MESSAGE = frozenset({"Received", "Processed"})  # FastStream's own lines for each message


class FastStreamNoise(logging.Filter):
    """Keeps out of the service's log the FastStream records that report nothing wrong.

    * ``callback for Task-N is being executed...``: its task supervisor, at INFO, for every
      subscriber task that ends (each stop).
    * ``Task-N raised an exception, retrying...`` for a NATS pull whose fetch found nothing before
      its deadline: FastStream's pull loop suppresses nats-py's own ``TimeoutError``, but nats-py
      also raises a bare ``asyncio.TimeoutError`` there, so an idle stream ended the loop, the
      supervisor restarted it (all that should happen) and logged an ERROR traceback.

    * ``Received`` and ``Processed``, at INFO for every message: logged outside the consume
      wrapper, so under the worker's correlation id and no tenant; the wrapper logs its own, under
      the message's (``consume.subscribers``).

    Any other exception a subscriber task raises keeps its ERROR."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if message.startswith("callback for ") and message.endswith(" is being executed..."):
            return False
        if message in PER_MESSAGE and record.levelno == logging.INFO:
            return False
        error = record.exc_info[1] if record.exc_info else None
        return not (type(error) is TimeoutError and _raised_by_a_nats_fetch(error))


def _raised_by_a_nats_fetch(error: BaseException) -> bool:
    return any(
        frame.f_code.co_name in {"fetch", "_fetch_n", "_fetch_one"}
        and f"{os.sep}nats{os.sep}js{os.sep}" in frame.f_code.co_filename
        for frame, _ in traceback.walk_tb(error.__traceback__)
    )


BROKER_LOG.addFilter(FastStreamNoise())


# How long a stream or subject seen with a consumer is taken to still have one: the check is a
# round trip per publish, and consumers are rarely removed (a removed one shows within this).
KNOWN_CONSUMER_SECONDS = 30.0


# How long the look-up after an accepted publish may take (it runs inside the delivery's limit).
LOOKUP_SECONDS = 2.0


class KnownConsumers:
    """Where a consumer was seen lately, so a log-based broker (Redis Streams, JetStream) asks
    whether anyone reads a destination only while nobody was seen there: an unrouted publish
    costs one more round trip, a routed one none after the first."""

    def __init__(self, seconds: float = KNOWN_CONSUMER_SECONDS) -> None:
        self._seconds = seconds
        self._seen: dict[str, float] = {}

    async def unrouted(
        self, destination: str, has_consumer: Callable[[], Awaitable[bool]], detail: str
    ) -> Unrouted | None:
        """:class:`Unrouted` with ``detail`` when ``has_consumer()`` finds nobody reading. Asked
        after the broker accepted the publish, so a look-up that fails or does not answer within
        :data:`LOOKUP_SECONDS` says "routed" (a debug line): it must never turn an accepted publish
        into a failure, which would publish the row again."""
        now = time.monotonic()
        if now - self._seen.get(destination, -self._seconds) < self._seconds:
            return None
        try:
            async with asyncio.timeout(LOOKUP_SECONDS):
                found = await has_consumer()
        except Exception as error:  # noqa: BLE001 (any failure of the look-up: the publish stands)
            log.debug("could not tell whether anyone reads %s: %r", destination, error)
            return None
        if found:
            self._seen[destination] = now
            return None
        return Unrouted(detail)


class PingFailedError(ConnectionError):
    """The broker did not answer."""


class ReceivedMessage:
    """What every transport's delivery shares: headers, body, message id and the ack."""

    def __init__(self, message: Any, headers: Mapping[str, object] | None = None) -> None:  # noqa: ANN401 (a FastStream message)
        self._message = message
        self.headers: dict[str, object] = dict(message.headers or {}) if headers is None else dict(headers)
        self.body: bytes = message.body

    @property
    def message_id(self) -> str:
        return message_id_of(self.headers)

    async def ack(self) -> None:
        await self._message.ack()

    @property
    def heartbeat_seconds(self) -> float | None:
        return None  # RabbitMQ and Kafka do not redeliver to a live consumer

    async def touch(self) -> None:
        return None


class ConsumingOnly:
    """A FastStream broker middleware applied to consumed messages only, passed by on publish.

    FastStream's telemetry middleware, on a publish, replaces the message's ``traceparent`` with
    one of its own spans: the ``traceparent`` is a signed header, so every signed message would
    then fail verification at its consumer. The service's delivery span already stands for the
    publish; on the consuming side the middleware only reads the headers."""

    def __init__(self, middleware: Callable[..., Any]) -> None:
        self._middleware = middleware

    def __call__(self, message: object, /, *, context: Any) -> Any:  # noqa: ANN401 (FastStream's types)
        if message is None:  # FastStream builds a publish's middlewares without a message
            return BaseMiddleware(message, context=context)
        return self._middleware(message, context=context)


async def publish_each(
    publish: Callable[[Envelope, dict[str, str]], Awaitable[Unrouted | None]],
    messages: Sequence[tuple[Envelope, dict[str, str]]],
    window: int,
    timeout_seconds: float | None,
) -> list[PublishResult]:
    """``publish`` every message, ``window`` in flight at once, each within ``timeout_seconds``
    of its start (None: ``publish`` bounds itself); the broker pipelines them, each waits for its
    own acknowledgement only."""
    gate = asyncio.Semaphore(max(1, window))

    async def one(envelope: Envelope, headers: dict[str, str]) -> Unrouted | None:
        async with gate, asyncio.timeout(timeout_seconds):
            return await publish(envelope, headers)

    if len(messages) == 1:  # no gather, no task: a lone publish runs in the caller's task
        envelope, headers = messages[0]
        try:
            return [await one(envelope, headers)]
        except Exception as error:  # noqa: BLE001 (the message's outcome, as in a batch)
            return [error]
    return list(await asyncio.gather(*(one(e, h) for e, h in messages), return_exceptions=True))


# Errors that mean the broker could not be reached, on every transport (each adds its client's own).
OUTAGES = (ConnectionError, TimeoutError, OSError)


class FastStreamTransport:
    """A broker behind the message bus port (:class:`~outbox_kit.transports.bus.MessageBus`), on
    FastStream: the publish every transport shares (sign, CloudEvent headers, the time limit,
    outages told from refusals), the broker's lifecycle, and what a broker adds to publishing:
    the way in (``consume/`` subscribes each consumer's wrapper), its topology and its dead
    letters. A subclass sets the broker, puts one signed message on it (:meth:`send`) and lays
    out its queues, streams or topics."""

    broker: Any
    label = "the broker"
    cloud_events_prefix = "ce-"  # the HTTP and NATS bindings' form (RabbitMQ and Redis have none)
    # FastStream's Prometheus middleware for this broker (set by the subclass, like the broker).
    metrics_middleware: Callable[..., Any]

    def __init__(self, settings: MessageBusSettings, names: EndpointNames, signer: Signer) -> None:
        self.name = settings.transport.value
        self.names = names
        self._settings = settings
        self._signer = signer
        self._source = f"/{names.namespace}"  # a CloudEvent's source: the service that published it
        self._consumers: list[Consumer[Any]] = []

    # FastStream's publish metrics, for a publish that goes beneath the broker's middlewares.
    _publish_metrics: Any = None

    def count_in(self, registry: CollectorRegistry) -> None:
        """Add FastStream's own broker metrics (``faststream_*``: received, processed, published,
        durations, by destination and status) to ``registry``, before the first subscribe."""
        middleware = self.metrics_middleware(registry=registry)
        self.broker.add_middleware(middleware)
        # The same counters the middleware keeps (``faststream_published_messages_*``; FastStream
        # 0.7 names its manager privately, and test_brokers proves the counts still arrive).
        self._publish_metrics = middleware._metrics_manager  # noqa: SLF001

    def count_published(
        self, broker: str, destination: str, seconds: float, error: BaseException | None
    ) -> None:
        """Record one publish as FastStream's middleware would have (names, labels, status)."""
        metrics = self._publish_metrics
        if metrics is None:
            return
        metrics.observe_published_message_duration(duration=seconds, broker=broker, destination=destination)
        if error is not None:
            metrics.add_published_message_exception(
                broker=broker, destination=destination, exception_type=type(error).__name__
            )
        status = PublishingStatus.error if error is not None else PublishingStatus.success
        metrics.add_published_message(broker=broker, destination=destination, status=status)

    def trace_consumes_with(self, tracer_provider: TracerProvider) -> None:
        """Open FastStream's ``process`` span (messaging semantic conventions) around every
        consumed message, child of its ``traceparent``, reported to ``tracer_provider``; publishes
        are left alone (their ``traceparent`` is signed). Before the first subscribe."""
        self.broker.add_middleware(ConsumingOnly(self.telemetry_middleware(tracer_provider)))

    def telemetry_middleware(self, tracer_provider: TracerProvider) -> Any:  # noqa: ANN401
        """FastStream's telemetry middleware for this broker (imported here: OpenTelemetry is the
        optional ``otel`` extra)."""
        raise NotImplementedError

    # -- publishing: the message bus port --------------------------------------------------------

    async def publish(self, envelope: Envelope) -> Unrouted | None:
        """One message: a batch of one (no task, no gather: see :func:`publish_each`)."""
        (result,) = await self.publish_batch([envelope], 1)
        if isinstance(result, BaseException):
            raise result
        return result

    async def publish_batch(self, envelopes: Sequence[Envelope], window: int) -> list[PublishResult]:
        """Sign each envelope and publish them together; an outage becomes
        :class:`BrokerUnavailableError` (the circuit breaker's), any other error stays the message's."""
        messages = [(envelope, self._headers(envelope)) for envelope in envelopes]
        try:
            results = await self.send_batch(messages, window)
        except Exception as error:  # noqa: BLE001 (before any message: the batch's channel, say)
            return [self._classified(error)] * len(messages)
        return [
            self._classified(result) if isinstance(result, BaseException) else result for result in results
        ]

    async def send_batch(
        self, messages: Sequence[tuple[Envelope, dict[str, str]]], window: int
    ) -> list[PublishResult]:
        """Put every signed message on the broker, up to ``window`` awaiting its acknowledgement at
        once (the broker pipelines them), each within ``MESSAGE_BUS__PUBLISH_TIMEOUT_SECONDS``; one
        result per message, in order: a message's error is its result, never raised. By default
        each through :meth:`send` (see :func:`publish_each`)."""
        return await publish_each(self.send, messages, window, self._settings.publish_timeout_seconds)

    async def send(self, envelope: Envelope, headers: dict[str, str]) -> Unrouted | None:
        """Put one signed message on the broker, durably accepted; :class:`Unrouted` when no
        consumer was bound to take it."""
        raise NotImplementedError

    def is_outage(self, error: BaseException) -> bool:
        """True when ``error`` means the broker is unreachable (not that the message is bad)."""
        raise NotImplementedError

    def _headers(self, envelope: Envelope) -> dict[str, str]:
        headers = self._signer.sign(envelope.headers(), envelope.body)
        headers.update(cloud_event_headers(envelope, source=self._source, prefix=self.cloud_events_prefix))
        return headers

    def _classified(self, error: BaseException) -> BaseException:
        if isinstance(error, OUTAGES) or self.is_outage(error):
            outage = BrokerUnavailableError(f"{self.name} is unreachable: {type(error).__name__}: {error}")
            outage.__cause__ = error
            return outage
        return error

    # -- the way in and the topology ---------------------------------------------------------------

    def subscribe(self, consumer: Consumer[Any], handler: DeliveryHandler) -> None:
        """Deliver ``consumer``'s messages to ``handler`` once consuming starts; :meth:`start`
        declares the consumer's queues or streams."""
        self._consumers.append(consumer)
        self.listen(consumer, handler)

    def listen(self, consumer: Consumer[Any], handler: DeliveryHandler) -> None:
        """Attach ``handler`` to ``consumer``'s queue, stream or topic on the broker."""
        raise NotImplementedError

    async def declare(self, consumers: Sequence[Consumer[Any]]) -> None:
        """Create what ``consumers`` read from and their retry and dead-letter destinations
        (idempotent: a second replica starting finds them)."""
        raise NotImplementedError

    async def drop_topology(self, consumers: Sequence[Consumer[Any]]) -> None:
        """Delete what :meth:`declare` created, messages included."""
        raise NotImplementedError

    async def read_dead_letters(self, consumer: Consumer[Any], limit: int) -> list[DeadLetterCopy]:
        raise NotImplementedError

    async def dead_letters(self, consumer_name: str, limit: int = 100) -> list[DeadLetterCopy]:
        """Read a consumer's dead letters (RabbitMQ consumes them; the others only read)."""
        (consumer,) = [c for c in self._consumers if c.name == consumer_name]
        return await self.read_dead_letters(consumer, limit)

    async def delete_topology(self) -> None:
        """Remove this service's queues, streams and exchanges from the broker, messages included.
        For tests and for decommissioning a namespace; never called by the service itself."""
        await self.connect()
        try:
            await self.drop_topology(self._consumers)
        finally:
            await self.close()

    # -- the lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect and declare the topology of every subscribed consumer."""
        await self.connect()
        await self.declare(self._consumers)

    async def stop(self) -> None:
        await self.close()

    async def connect(self) -> None:
        await self.broker.connect()

    async def start_consuming(self) -> None:
        await self.broker.start()

    async def close(self) -> None:
        await self.broker.stop()

    async def ping(self) -> None:
        """FastStream's own: a real round trip for Redis (PING) and Kafka (a metadata request);
        RabbitMQ and NATS override it (FastStream reads a flag of the client there)."""
        if not await self.broker.ping(timeout=2.0):
            msg = f"{self.label} did not answer"
            raise PingFailedError(msg)
