"""What a broker transport gives the consume wrapper (a received message with its ack, retry and
dead-letter steps) and what it is (topology, publish, subscribe), as Protocols."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ...application.handler_types import Consumer
from ...messaging.envelope import Envelope

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider
    from prometheus_client import CollectorRegistry


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
