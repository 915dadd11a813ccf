"""The message bus port. Only the outbox processor publishes integration events through it."""

from __future__ import annotations

from typing import Protocol

from .envelope import Envelope


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

    async def publish(self, envelope: Envelope) -> None:
        """Hand one message to the transport; return only once it is durably accepted."""
        ...

    async def ping(self) -> None:
        """Raise unless the transport is reachable (used by /readyz)."""
        ...
