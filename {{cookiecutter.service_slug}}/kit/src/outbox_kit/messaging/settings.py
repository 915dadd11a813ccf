"""The message bus: the transport chosen at run time, the tri-state outbox and inbox switches
(unset resolves ON for a broker, OFF in-process), signing keys, consumer redelivery, the publish
circuit breaker and Kafka topics."""

from __future__ import annotations

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
    # tests/unit/test_settings.py checks it): below that, an identity the API accepts could be
    # dead-lettered as oversized_header by every consumer.
    max_header_bytes: int = Field(default=4096, ge=2048)
    publish_timeout_seconds: float = Field(default=10.0, gt=0)
    # Below OUTBOX__DELIVERY_TIMEOUT_SECONDS (60): in-process, the consumers run inside a delivery.
    handler_timeout_seconds: float = Field(
        default=30.0, gt=0, description="Time limit of one consumer handler run; past it, a failed attempt"
    )
    circuit_failure_threshold: int = Field(default=5, ge=1)
    circuit_reset_seconds: float = Field(default=30.0, gt=0)
    kafka_create_topics: bool = True
    kafka_topic_partitions: int = Field(default=3, ge=1)
    kafka_replication_factor: int = Field(default=1, ge=1)

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
