"""What every broker transport provides to the FastStream bus."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ...handlers import Consumer
from ..envelope import MESSAGE_ID, Envelope

OWN_HEADER_PREFIXES = ("x-", "traceparent")


class Delivery(Protocol):
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


DeliveryHandler = Callable[[Delivery], Awaitable[None]]


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


def own_headers(headers: Mapping[str, object]) -> dict[str, str]:
    """Our headers (x-*, traceparent) as strings: what a dead-letter copy carries along."""
    kept: dict[str, str] = {}
    for name, value in headers.items():
        if name.startswith(OWN_HEADER_PREFIXES) and name not in ("x-death", "x-delivery-count"):
            kept[name] = value.decode() if isinstance(value, bytes) else str(value)
    return kept


def dead_letter_headers(
    headers: Mapping[str, object], error: str, attempt: int, origin: str
) -> dict[str, str]:
    return own_headers(headers) | {
        "x-error": error[:1000],
        "x-attempts": str(attempt),
        "x-original-address": origin,
    }


def as_text(headers: Mapping[str, object]) -> dict[str, str]:
    return {k: v.decode() if isinstance(v, bytes) else str(v) for k, v in headers.items()}


def message_id_of(headers: Mapping[str, object]) -> str:
    value = headers.get(MESSAGE_ID, "?")
    return value.decode() if isinstance(value, bytes) else str(value)


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


class FastStreamTransport:
    """The broker lifecycle every transport shares (the broker itself is set by the subclass)."""

    broker: Any
    label = "the broker"

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
