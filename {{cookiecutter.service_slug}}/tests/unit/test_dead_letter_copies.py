"""A dead-letter copy waits for the broker as long as every other publish does.

The copy is the last thing a poison message gets. FastStream's NATS publish waits only 0.5 s for
the server's acknowledgement unless told otherwise; a busy server that answered later failed the
copy (seen in CI), and the message went round again instead of landing on the dead-letter
stream. Both brokers whose publish takes a timeout get the service's ``publish_timeout_seconds``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

import pytest

from {{ cookiecutter.package_name }}.building_blocks.brokers.transports.nats_delivery import (
    NatsDelivery,
)
from {{ cookiecutter.package_name }}.building_blocks.brokers.transports.rabbit_delivery import (
    RabbitDelivery,
)

pytestmark = pytest.mark.unit


@dataclass
class RecordingBroker:
    """Stands in for a FastStream broker: keeps what it was asked to publish."""

    published: list[dict[str, Any]] = field(default_factory=list)

    async def publish(self, body: bytes, *args: object, **options: object) -> None:
        self.published.append({"body": body, "args": args, **options})


@dataclass
class Received:
    """Stands in for a FastStream message: its body, headers and acknowledgement."""

    body: bytes = b'{"n": 1}'
    headers: dict[str, str] = field(default_factory=lambda: {"message-id": "m-1"})
    content_type: str = "application/json"
    message_id: str = "m-1"
    raw_message: Any = field(default_factory=lambda: SimpleNamespace(subject="events.kit", headers={}))
    acked: bool = False

    async def ack(self) -> None:
        self.acked = True


async def test_a_nats_dead_letter_copy_uses_the_publish_timeout() -> None:
    broker, message = RecordingBroker(), Received()
    delivery = NatsDelivery(
        cast("Any", message),
        cast("Any", broker),
        dlq_subject="dlq.kit",
        dlq_stream="dead-letters",
        delay=1.0,
        publish_timeout=7.5,
    )
    await delivery.dead_letter("handler_failed: boom", attempt=3)
    (copy,) = broker.published
    assert copy["timeout"] == 7.5
    assert copy["stream"] == "dead-letters"
    assert copy["body"] == message.body
    assert message.acked, "the original is acknowledged once its copy is safe"


async def test_a_rabbitmq_dead_letter_copy_uses_the_publish_timeout() -> None:
    broker, message = RecordingBroker(), Received()
    delivery = RabbitDelivery(
        cast("Any", message), cast("Any", broker), "kit", "kit.dlq", publish_timeout=7.5
    )
    await delivery.dead_letter("handler_failed: boom", attempt=3)
    (copy,) = broker.published
    assert copy["timeout"] == 7.5
    assert copy["queue"] == "kit.dlq"
    assert message.acked
