"""The message bus's settings and the names of its endpoints.

**The settings**: the transport chosen at run time, the tri-state outbox and inbox switches
(unset resolves ON for a broker, OFF in-process), signing keys, consumer redelivery, the publish
circuit breaker and Kafka topics.

**Broker names**: one channel per integration event, one queue or group per consumer. Every name
is prefixed with the application namespace (``APPLICATION__NAMESPACE``, the service slug when
unset), so two applications sharing one broker never share a queue by accident;
``MESSAGE_BUS__PRESERVE_DEFAULT_ENDPOINT_NAMES=true`` keeps the bare names (for a cutover from a
service that used them)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, Field, SecretStr, field_validator
from pydantic_settings import NoDecode


class Transport(StrEnum):
    """Where integration events travel. In-process needs no server."""

    INPROCESS = "inprocess"
    RABBITMQ = "rabbitmq"
    KAFKA = "kafka"
    NATS = "nats"
    REDIS = "redis"


# The signing key .env.example ships with, and the shortest key production accepts.
EXAMPLE_SIGNING_SECRET = "change-me-local-signing-key"  # noqa: S105 (refused in production)

MIN_PRODUCTION_KEY_LENGTH = 16


class MessageBusSettings(BaseModel):
    """The transport and the outbox/inbox switches (tri-state, see the module docstring)."""

    transport: Transport = Transport.INPROCESS
    url: str = ""
    enable_outbox: bool | None = None
    enable_inbox: bool | None = None
    preserve_default_endpoint_names: bool = False
    signing_keys: Annotated[dict[str, SecretStr], NoDecode] = Field(default_factory=dict)
    signing_key_id: str = ""
    allow_unsigned: bool = False
    max_delivery_attempts: int = Field(default=5, ge=1)
    redelivery_delay_seconds: float = Field(default=1.0, gt=0)
    database_outage_hold_seconds: float = Field(default=60.0, ge=0)
    # At least what the signed headers take at their own limits (1,530 bytes, names included;
    # the kit's test_settings.py checks it): below that, an identity the API accepts could be
    # dead-lettered as oversized_header by every consumer.
    max_header_bytes: int = Field(default=4096, ge=2048)
    # RabbitMQ's <namespace>.unrouted keeps at most this many copies, the oldest dropped first: a
    # contract published for weeks before its first consumer must not fill the broker (a memory
    # or disk alarm blocks every publisher on it). Fixed when the queue is first declared.
    unrouted_max_messages: int = Field(default=10_000, ge=1)
    # Both below OUTBOX__DELIVERY_TIMEOUT_SECONDS (the handler's in-process only, where consumers
    # run inside a delivery); unset, they follow it (``runtime.time_limits``).
    publish_timeout_seconds: float = Field(default=10.0, gt=0)
    handler_timeout_seconds: float = Field(
        default=30.0, gt=0, description="Time limit of one consumer handler run; past it, a failed attempt"
    )
    # Messages of one consumer that are ready at once are consumed in one transaction, at most
    # this many (consume.batch); 1 consumes each in a transaction of its own.
    consume_batch_size: int = Field(default=32, ge=1, le=1000)
    # At most this many of those transactions of one consumer at once: a slow handler holds up
    # only its own batch.
    consume_concurrency: int = Field(default=4, ge=1, le=100)
    circuit_failure_threshold: int = Field(default=5, ge=1)
    circuit_reset_seconds: float = Field(default=30.0, gt=0)
    kafka_create_topics: bool = True
    kafka_topic_partitions: int = Field(default=3, ge=1)
    kafka_replication_factor: int = Field(default=1, ge=1)
    # How long a consumer group waits for a silent member before giving its partitions to another
    # (heartbeats every third of it). The broker bounds it (Apache Kafka: 6 s to 30 min), and a
    # Kafka-protocol broker may hold a new group's join for part of it (tansu: half).
    kafka_session_timeout_seconds: float = Field(default=10.0, gt=0)

    @field_validator("signing_keys", mode="before")
    @classmethod
    def _parse_keys(cls, value: object) -> object:
        """Accept ``kid1:secret1,kid2:secret2`` from the environment."""
        if not isinstance(value, str):
            return value
        keys: dict[str, str] = {}
        for item in filter(None, (part.strip() for part in value.split(","))):
            kid, sep, secret = item.partition(":")
            if not sep or not kid or not secret:
                msg = "MESSAGE_BUS__SIGNING_KEYS must look like 'kid:secret,kid2:secret2'"
                raise ValueError(msg)
            keys[kid] = secret
        return keys

    @property
    def is_broker(self) -> bool:
        return self.transport is not Transport.INPROCESS

    @property
    def outbox_enabled(self) -> bool:
        return self.is_broker if self.enable_outbox is None else self.enable_outbox

    @property
    def inbox_enabled(self) -> bool:
        return self.is_broker if self.enable_inbox is None else self.enable_inbox

    @property
    def active_key_id(self) -> str | None:
        if self.signing_key_id:
            return self.signing_key_id
        return next(iter(self.signing_keys), None)


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

    def unrouted(self) -> str:
        """The RabbitMQ queue that keeps what was published with no consumer queue bound."""
        return self._prefixed("unrouted")

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
