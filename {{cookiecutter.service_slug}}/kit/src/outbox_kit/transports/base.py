"""What every broker layer implements (the transport port), and the FastStream base they share.

What a broker transport gives the consume wrapper (a received message with its ack, retry and
dead-letter steps) and what it is (topology, publish, subscribe), as Protocols.

What every broker transport provides to the FastStream bus.

Everything that arrives is untrusted, bytes and headers alike, and every message must end
acknowledged: processed, retried (bounded) or dead-lettered with a reason. So the transports:

* hand the body over undecoded (:func:`undecoded_body` replaces FastStream's decoder, which would
  run ``json.loads`` before the service sees the message: a 5,000-digit integer or a deeply
  nested array raised there, outside any error handling, and the message stayed unacknowledged);
  the consume pipeline decodes it, where a bad body is a rejection;
* read the broker's delivery counters strictly (:func:`broker_count`): a counter the broker
  would never write was forged or mangled on the way, and with it the retries can no longer be
  bounded, so the message is rejected (``malformed_header``) instead of trusted or crashed on;
* copy header values onto dead-letter copies only as one line of valid UTF-8 text, bounded
  (:func:`own_headers`): a value that is not UTF-8 used to crash the copy itself; and size each
  copy against what the broker accepts before publishing it (copies.py): an oversized copy used
  to close a RabbitMQ or NATS connection, or block a Kafka partition;
* where FastStream's own parser fails on what a broker can carry (Redis, Kafka), parse a
  readable stand-in instead (:func:`fallback_parser`), so the handler runs and ends the message."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from outbox_kit.application.handlers import Consumer
from outbox_kit.transports.envelope import Envelope

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider
    from prometheus_client import CollectorRegistry
import logging
from typing import TYPE_CHECKING

from faststream import BaseMiddleware

from outbox_kit.transports.headers import message_id_of


class BrokerDelivery(Protocol):
    """One received message, with the transport's ack / retry / dead-letter steps."""

    body: bytes

    @property
    def headers(self) -> Mapping[str, object]: ...

    @property
    def message_id(self) -> str: ...

    async def attempt(self) -> int:
        """1 for the first delivery, 2 for the first redelivery, ..."""
        ...

    async def ack(self) -> None: ...

    async def retry(self, attempt: int) -> None:
        """Ask the broker to deliver the message again after a delay."""
        ...

    async def dead_letter(self, error: str, attempt: int) -> None:
        """Publish a copy to the dead-letter destination (confirmed), then ack the original."""
        ...

    @property
    def heartbeat_seconds(self) -> float | None:
        """How often ``touch`` must run while the handler works (None: never)."""
        ...

    async def touch(self) -> None:
        """Tell the broker the message is still being worked on (no redelivery meanwhile)."""
        ...


DeliveryHandler = Callable[[BrokerDelivery], Awaitable[None]]


@dataclass(frozen=True)
class DeadLetterCopy:
    """A message found in a consumer's dead-letter destination."""

    headers: dict[str, str]
    body: bytes

    @property
    def error(self) -> str:
        return self.headers.get("x-error", "")


class BrokerTransport(Protocol):
    """Topology, publish and subscribe for one broker."""

    broker: Any

    def subscribe(self, consumer: Consumer[Any], handler: DeliveryHandler) -> None: ...

    def count_in(self, registry: CollectorRegistry) -> None:
        """Add FastStream's own broker metrics (``faststream_*``: received, processed, published,
        durations, by destination and status) to ``registry``, before the first subscribe."""

    def trace_consumes_with(self, tracer_provider: TracerProvider) -> None:
        """Open FastStream's ``process`` span (messaging semantic conventions) around every
        consumed message, child of its ``traceparent``, reported to ``tracer_provider``; publishes
        are left alone (their ``traceparent`` is signed). Before the first subscribe."""

    async def connect(self) -> None: ...

    async def declare(self, consumers: Sequence[Consumer[Any]]) -> None: ...

    async def start_consuming(self) -> None: ...

    async def close(self) -> None: ...

    async def ping(self) -> None: ...

    async def publish(self, envelope: Envelope, headers: dict[str, str]) -> None: ...

    async def dead_letters(self, consumer: Consumer[Any], limit: int = 100) -> list[DeadLetterCopy]:
        """Read a consumer's dead letters (RabbitMQ consumes them; the others only read)."""
        ...

    def is_outage(self, error: BaseException) -> bool:
        """True when ``error`` means the broker is unreachable (not that the message is bad)."""
        ...

    async def delete_topology(self, consumers: Sequence[Consumer[Any]]) -> None:
        """Delete what ``declare`` created, messages included (tests, decommissioning)."""
        ...


log = logging.getLogger(__name__)
# FastStream's own records (a subscriber waiting, a message that failed) go through the service's
# handler like every other record: FastStream's default logger paints ANSI colours even into a
# file, and it would bypass the escaping and credential masking of the service's log format.
BROKER_LOG = logging.getLogger(f"{__name__.rpartition('.')[0]}.faststream")


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


class FastStreamTransport:
    """The broker lifecycle every transport shares (the broker itself is set by the subclass)."""

    broker: Any
    label = "the broker"
    # FastStream's Prometheus middleware for this broker (set by the subclass, like the broker).
    metrics_middleware: Callable[..., Any]

    def count_in(self, registry: CollectorRegistry) -> None:
        self.broker.add_middleware(self.metrics_middleware(registry=registry))

    def trace_consumes_with(self, tracer_provider: TracerProvider) -> None:
        self.broker.add_middleware(ConsumingOnly(self.telemetry_middleware(tracer_provider)))

    def telemetry_middleware(self, tracer_provider: TracerProvider) -> Any:  # noqa: ANN401
        """FastStream's telemetry middleware for this broker (imported here: OpenTelemetry is the
        optional ``otel`` extra)."""
        raise NotImplementedError

    async def connect(self) -> None:
        await self.broker.connect()

    async def start_consuming(self) -> None:
        await self.broker.start()

    async def close(self) -> None:
        await self.broker.stop()

    async def ping(self) -> None:
        if not await self.broker.ping(timeout=2.0):
            msg = f"{self.label} did not answer"
            raise PingFailedError(msg)
