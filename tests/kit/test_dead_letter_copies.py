"""A dead-letter copy waits for the broker as long as every other publish does, and is sized
against what the broker accepts.

The copy is the last thing a poison message gets. FastStream's NATS publish waits only 0.5 s for
the server's acknowledgement unless told otherwise; a busy server that answered later failed the
copy (seen in CI), and the message went round again instead of landing on the dead-letter
stream. Both brokers whose publish takes a timeout get the service's ``publish_timeout_seconds``.

A copy the broker would refuse is shrunk before it is published, and one it refuses all the same
is sent again minimal (the real brokers' side is in tests/integration/test_hostile_messages.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

import pytest
from nats.errors import ConnectionClosedError
from nats.js.errors import BadRequestError
from outbox_kit.transports.nats import NatsDelivery, retry_delay
from outbox_kit.transports.rabbit import RabbitDelivery
from pamqp.encode import field_table

pytestmark = pytest.mark.unit


@dataclass
class RecordingBroker:
    """Stands in for a FastStream broker: keeps what it was asked to publish."""

    published: list[dict[str, Any]] = field(default_factory=list)

    async def publish(self, body: bytes, *args: object, **options: object) -> None:
        self.published.append({"body": body, "args": args, **options})


@dataclass
class RefusingBroker(RecordingBroker):
    """Refuses the first publish with ``error``, then keeps what it is asked to publish."""

    error: BaseException = field(default_factory=lambda: RuntimeError("refused"))
    refused: int = 0

    async def publish(self, body: bytes, *args: object, **options: object) -> None:
        if not self.refused:
            self.refused += 1
            raise self.error
        await super().publish(body, *args, **options)


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
        longest_delay=4.0,
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


SIGNED = {
    "x-message-id": "m-1",
    "x-event-name": "kit.counter_changed",
    "x-context-signature": "v1=k1:abc",
}
FOREIGN = {f"x-h{i:03}": "\x01" * 250 for i in range(200)}  # 1,000 characters each once escaped


def nats_delivery(broker: RecordingBroker, message: Received) -> NatsDelivery:
    return NatsDelivery(
        cast("Any", message),
        cast("Any", broker),
        dlq_subject="dlq.kit",
        dlq_stream="dead-letters",
        delay=1.0,
        longest_delay=4.0,
        publish_timeout=7.5,
    )


async def test_a_copy_keeps_the_signed_headers_and_a_bounded_few_others() -> None:
    broker, message = RecordingBroker(), Received(headers=SIGNED | FOREIGN)
    await nats_delivery(broker, message).dead_letter("rejected: unsigned: no signature", attempt=1)
    (copy,) = broker.published
    headers = copy["headers"]
    assert {name: headers[name] for name in SIGNED} == SIGNED
    others = [name for name in headers if name.startswith("x-h")]
    assert 0 < len(others) <= 32
    assert sum(len(name) + len(headers[name]) for name in others) <= 8 * 1024
    assert headers["x-truncated"].startswith(f"headers: {len(FOREIGN) - len(others)} left out")
    assert headers["x-error"] == "rejected: unsigned: no signature"
    assert copy["body"] == message.body


async def test_a_copy_the_broker_refuses_is_sent_again_minimal() -> None:
    refusal = BadRequestError(
        code=400, err_code=10097, description="header size exceeds maximum allowed of 64k"
    )
    broker, message = RefusingBroker(error=refusal), Received(headers=SIGNED | FOREIGN)
    await nats_delivery(broker, message).dead_letter("handler_failed: boom", attempt=3)
    (copy,) = broker.published
    assert copy["body"] == b""
    assert {name for name in copy["headers"] if name.startswith("x-h")} == set()
    assert {name: copy["headers"][name] for name in SIGNED} == SIGNED
    assert copy["headers"]["x-error"] == "handler_failed: boom"
    assert copy["headers"]["x-attempts"] == "3"
    assert "refused whole (BadRequestError" in copy["headers"]["x-truncated"]
    assert message.acked


async def test_an_outage_is_not_mistaken_for_a_refusal_of_the_copy() -> None:
    """The connection is gone: a smaller copy would not help, and the message must not be
    acknowledged (the consume wrapper hands it back to the broker's redelivery)."""
    broker, message = RefusingBroker(error=ConnectionClosedError()), Received(headers=SIGNED | FOREIGN)
    with pytest.raises(ConnectionClosedError):
        await nats_delivery(broker, message).dead_letter("handler_failed: boom", attempt=3)
    assert broker.published == []
    assert not message.acked


async def test_a_nats_copy_over_max_payload_has_its_body_cut_and_says_so() -> None:
    """The server closes the whole connection on a message over max_payload (headers included;
    the client checks only the body), so the copy is cut before it is published."""
    client = SimpleNamespace(max_payload=64 * 1024)
    raw = SimpleNamespace(subject="events.kit", headers={}, _client=client)
    body = b"b" * (64 * 1024 - 200)  # fitted with its few headers; not with the copy's
    broker, message = RecordingBroker(), Received(body=body, headers=SIGNED, raw_message=raw)
    await nats_delivery(broker, message).dead_letter("rejected: unsigned: no signature", attempt=1)
    (copy,) = broker.published
    block = 12 + sum(len(k) + len(v) + 4 for k, v in copy["headers"].items())
    assert block + len(copy["body"]) <= client.max_payload - 1024
    assert body.startswith(copy["body"])
    assert copy["headers"]["x-truncated"].startswith(f"body: first {len(copy['body'])} of {len(body)} bytes")


async def test_a_rabbitmq_copy_fits_the_connections_frame_max() -> None:
    """A header table over frame_max is a connection error on RabbitMQ: checked before."""
    tune = SimpleNamespace(frame_max=4096)  # the smallest frame_max a server may negotiate
    channel = SimpleNamespace(connection=SimpleNamespace(connection_tune=tune))
    raw = SimpleNamespace(channel=channel, headers=SIGNED | FOREIGN)  # RabbitMQ reads the raw headers
    broker, message = RecordingBroker(), Received(raw_message=raw)
    delivery = RabbitDelivery(
        cast("Any", message), cast("Any", broker), "kit", "kit.dlq", publish_timeout=7.5
    )
    await delivery.dead_letter("rejected: unsigned: no signature", attempt=1)
    (copy,) = broker.published
    assert len(field_table(copy["headers"])) <= 4096 - 1024
    assert {name: copy["headers"][name] for name in SIGNED} == SIGNED
    assert copy["headers"]["x-truncated"].startswith("headers:")
    assert copy["body"] == message.body


def test_a_nats_message_handed_back_past_the_limit_waits_the_longest_backoff() -> None:
    """A message whose dead-letter copy is refused is handed back once per delivery, for as long
    as the refusal lasts: its nack delay stops doubling at the last retry's."""
    assert [retry_delay(0.5, attempt, 4.0) for attempt in (1, 2, 3, 4, 5, 40, 5000)] == [
        0.5,
        1.0,
        2.0,
        4.0,
        4.0,
        4.0,
        4.0,
    ]
