"""Kafka topics this service publishes to and consumes from, created at start-up where missing
(never altered); a refusal is one clear error."""

from __future__ import annotations

from typing import Any, Protocol

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import (
    TopicAlreadyExistsError,
)

TOPIC_EXISTS = int(TopicAlreadyExistsError.errno)


class KafkaAdmin(Protocol):
    """What the transport uses of aiokafka's admin client (a fake stands in for it in tests)."""

    async def start(self) -> None:
        """Connect to the cluster."""
        ...

    async def close(self) -> None:
        """Disconnect."""
        ...

    async def list_topics(self) -> list[str]:
        """Every topic of the cluster."""
        ...

    async def create_topics(self, new_topics: list[NewTopic]) -> Any:  # noqa: ANN401 (a protocol response)
        """Ask the controller to create topics; per-topic errors come back in ``topic_errors``."""
        ...


class KafkaTopologyError(RuntimeError):
    """The cluster refused to create a topic the service needs."""


def aiokafka_admin(bootstrap_servers: str) -> KafkaAdmin:
    admin: KafkaAdmin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers)
    return admin
