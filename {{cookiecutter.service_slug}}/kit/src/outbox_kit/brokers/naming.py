"""Broker names: one channel per integration event, one queue/group per consumer.

Every name is prefixed with the application namespace (``APPLICATION__NAMESPACE``, the service
slug when unset), so two applications sharing one broker never share a queue by accident
``MESSAGE_BUS__PRESERVE_DEFAULT_ENDPOINT_NAMES=true`` keeps the bare
names (for a cutover from a service that used them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


@dataclass(frozen=True)
class EndpointNames:
    """Computes every broker-side name of one service."""

    namespace: str
    preserve_default_names: bool = False

    def _prefixed(self, name: str) -> str:
        name = _UNSAFE.sub("-", name)
        return name if self.preserve_default_names else f"{_UNSAFE.sub('-', self.namespace)}.{name}"

    def channel(self, event_name: str) -> str:
        """Where events named ``event_name`` are published (exchange, subject or topic)."""
        return self._prefixed(event_name)

    def exchange(self) -> str:
        """The RabbitMQ topic exchange every event of this service is published to."""
        return self._prefixed("events")

    def queue(self, consumer: str) -> str:
        """The durable queue / consumer group / durable consumer of one consumer."""
        return self._prefixed(f"consumer.{consumer}")

    def retry_queue(self, consumer: str) -> str:
        return f"{self.queue(consumer)}.retry"

    def dead_letters(self, consumer: str) -> str:
        return f"{self.queue(consumer)}.dlq"

    def dead_letter_subject(self, consumer: str) -> str:
        """NATS subject of a consumer's dead letters (captured by the dead-letter stream)."""
        return f"dlq.{self.queue(consumer)}"

    def stream(self, kind: str) -> str:
        """A NATS stream name (letters, digits, dashes and underscores only)."""
        base = kind if self.preserve_default_names else f"{self.namespace}_{kind}"
        return re.sub(r"[^A-Za-z0-9_-]", "_", base).upper()
