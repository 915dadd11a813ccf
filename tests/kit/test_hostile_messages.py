"""Hostile input on the consume path of real brokers (RabbitMQ, Kafka, NATS JetStream, Redis
Streams).

The messages are published raw, past the service's publisher, next to one legitimate message.
Each hostile one must end in the consumer's dead-letter destination with its reason tag, counted;
the legitimate one must be processed once; and nothing may stay unacknowledged or pending on the
main queue or stream (where FastStream or the wrapper used to leave such messages for good).
"""

from __future__ import annotations

import asyncio
import json
import re
from datetime import UTC, datetime
from typing import Any

import pytest
from outbox_kit.runtime.container import OutboxContainer
from outbox_kit.testing.brokers import (
    EVENT,
    HEADER_VALUE_LIMIT,
    LEFTOVERS,
    LEGIT_BODY,
    PUBLISH_RAW,
    Hostile,
    HostileBatch,
    dead_letters_of,
    hostile_messages,
    publish_raw_rabbitmq,
    publish_redis_only,
    redis_only_messages,
)
from outbox_kit.testing.fixtures import SERVICE_URLS, eventually
from outbox_kit.transports.base import ReceivedMessage
from outbox_kit.transports.kafka import (
    KafkaDelivery,
)
from outbox_kit.transports.nats import (
    NatsDelivery,
)
from outbox_kit.transports.rabbit import (
    RabbitDelivery,
)
from outbox_kit.transports.redis import (
    RedisDelivery,
)
from test_brokers import CONSUMER, TRANSPORTS, Start, effects_become, effects_of, envelope
from test_brokers import start as start  # the fixture  # noqa: PLC0414

pytestmark = pytest.mark.integration


def counted(container: OutboxContainer, metric: str, reason: str) -> float:
    registry = container.metrics().registry
    return registry.get_sample_value(metric, {"consumer": CONSUMER, "reason": reason}) or 0.0


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_hostile_messages_are_dead_lettered_with_their_reason_and_none_stays_pending(
    start: Start, transport: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Each ends acknowledged: dead-lettered with its reason tag, counted and logged once."""
    container, observer = await start(transport)
    batch = hostile_messages(container, transport)
    await PUBLISH_RAW[transport](container, batch.messages)
    if transport == "redis":
        common = len(batch.messages)
        redis_only_messages(batch)
        await publish_redis_only(container, batch.messages[common:])
    legit = envelope(5)
    await container.bus().publish(legit)

    letters = await dead_letters_of(container, batch.messages, within=30)
    await effects_become(container, ["consumed:5"], timeout=30)
    await asyncio.sleep(1.0)  # three redelivery delays: a message still cycling would show
    await container.worker().stop()  # RabbitMQ requeues what was left unacknowledged

    reasons = {key: letter.error for key, letter in letters.items()}
    assert sorted(reasons) == sorted(m.message_id for m in batch.messages), reasons
    for message in batch.messages:
        assert reasons[message.message_id].startswith(f"rejected: {message.reason}:"), message.label
    assert [seen["message_id"] for seen in observer.seen] == [legit.message_id]
    assert set((await LEFTOVERS[transport](container)).values()) == {0}
    for reason in {m.reason for m in batch.messages}:
        expected = sum(1 for m in batch.messages if m.reason == reason)
        assert counted(container, "inbox_rejected_total", reason) == expected, reason
        assert counted(container, "inbox_dead_letters_total", reason) == expected, reason
    logged = [r for r in caplog.records if "rejected and dead-lettered" in r.getMessage()]
    assert len(logged) == len(batch.messages)  # an entry with no readable id is logged as "?"


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_signed_message_with_non_ascii_identifiers_is_processed_once(
    start: Start, transport: str
) -> None:
    """Any language's letters in the message id, tenant and user are text like any other: the
    signature verifies, the handler runs once, nothing is dead-lettered or left pending."""
    container, observer = await start(transport)
    message_id = "caf\u00e9-\u65e5\u672c"
    headers = {
        "x-message-id": message_id,
        "x-event-name": EVENT,
        "x-occurred-on": datetime.now(UTC).isoformat(),
        "x-tenant-id": "m\u00fcller",
        "x-user-id": "\u00e9lodie",
    }
    signed = container.signer().sign(headers, LEGIT_BODY)
    await PUBLISH_RAW[transport](container, [Hostile("non-ascii-ids", LEGIT_BODY, signed, "", message_id)])
    await eventually(lambda: len(observer.seen) == 1, timeout=30)
    await asyncio.sleep(1.0)  # three redelivery delays: a second run would show
    await container.worker().stop()
    (seen,) = observer.seen
    assert (seen["message_id"], seen["tenant"], seen["user"]) == (message_id, "m\u00fcller", "\u00e9lodie")
    assert await effects_of(container) == ["consumed:99"]
    assert set((await LEFTOVERS[transport](container)).values()) == {0}
    assert counted(container, "inbox_dead_letters_total", "internal_error") == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_dead_letter_copy_carries_only_clean_bounded_header_values(
    start: Start, transport: str
) -> None:
    """Header values copied onto a dead-letter copy are valid UTF-8 text without NUL or line
    breaks, and bounded in length, whatever the original carried."""
    container, _ = await start(transport)
    batch = HostileBatch(container, transport)
    junk = hostile_messages(container, transport).messages[3]
    batch.messages.append(junk)
    await PUBLISH_RAW[transport](container, batch.messages)
    letters = await dead_letters_of(container, batch.messages, within=30)
    (letter,) = letters.values()
    assert letter.headers["x-message-id"] == junk.message_id
    for name, value in letter.headers.items():
        assert value.encode("utf-8").decode("utf-8") == value
        assert not re.search(r"[\x00-\x1f\x7f-\x9f]", value), name
        assert len(value) <= HEADER_VALUE_LIMIT, name
    assert letter.headers["x-long"] == "y" * (HEADER_VALUE_LIMIT - 3) + "..."
    if transport != "nats":
        assert letter.headers["x-nul"] == r"a\x00b"
        assert letter.headers["x-newline"] == r"a\r\nforged: yes"
    if transport == "rabbitmq":
        assert letter.headers["x-junk"] == r"\xff\xfe not UTF-8"
        assert letter.headers["x-bytes"] == r"\x00\xff"


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_an_acknowledgement_that_fails_once_leaves_nothing_unacknowledged(
    start: Start, transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The handler committed, then the acknowledgement raised (a connection blip). The wrapper's
    last resort hands the message to the broker's bounded redelivery; the inbox makes that second
    run a duplicate, which is acknowledged: one effect, no dead letter, nothing pending."""
    delivery = DELIVERIES[transport]  # RabbitMQ's acknowledges its own way (no flush wait)
    acknowledge = delivery.ack
    failed: list[str] = []

    async def fails_once(self: ReceivedMessage) -> None:
        if not failed:
            failed.append(self.message_id)
            raise ConnectionResetError("the acknowledgement was lost")
        await acknowledge(self)

    monkeypatch.setattr(delivery, "ack", fails_once)
    container, observer = await start(transport)
    await container.bus().publish(envelope(6))
    registry = container.metrics().registry
    await eventually(
        lambda: registry.get_sample_value("inbox_duplicates_total", {"consumer": CONSUMER}) == 1.0,
        timeout=20,
    )
    await asyncio.sleep(1.0)  # three redelivery delays: a message still cycling would show
    await container.worker().stop()
    assert failed
    assert await effects_of(container) == ["consumed:6"]
    assert len(observer.seen) == 1
    assert set((await LEFTOVERS[transport](container)).values()) == {0}
    assert counted(container, "inbox_dead_letters_total", "internal_error") == 0


DELIVERIES = {
    "rabbitmq": RabbitDelivery,
    "kafka": KafkaDelivery,
    "nats": NatsDelivery,
    "redis": RedisDelivery,
}


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_an_unexpected_error_before_the_attempt_is_known_dead_letters_the_message(
    start: Start, transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without an attempt number a retry could not be bounded, so an error the wrapper did not
    expect at that point dead-letters the message at once, with the error, counted."""

    async def broken(self: object) -> int:
        del self
        raise RuntimeError("the delivery count could not be read")

    monkeypatch.setattr(DELIVERIES[transport], "attempt", broken)
    container, observer = await start(transport)
    message = envelope(7)
    await container.bus().publish(message)
    letters = await dead_letters_of(container, [], within=20, expected=1)
    await container.worker().stop()
    assert [letter.headers["x-message-id"] for letter in letters.values()] == [message.message_id]
    (letter,) = letters.values()
    assert letter.error == "internal_error: RuntimeError: the delivery count could not be read"
    assert letter.headers["x-attempts"] == "0"
    assert observer.seen == []
    assert set((await LEFTOVERS[transport](container)).values()) == {0}
    assert counted(container, "inbox_dead_letters_total", "internal_error") == 1


@pytest.mark.rabbitmq
async def test_a_refused_dead_letter_copy_leaves_no_rabbitmq_message_unacknowledged(start: Start) -> None:
    """The dead-letter queue is gone (deleted by hand), so every copy is refused (NO_ROUTE). The
    message is handed back through the retry queue instead of staying unacknowledged (where it
    would also hold a prefetch slot), and reaches the dead-letter queue once that exists again."""
    import aio_pika

    container, _ = await start("rabbitmq")
    dead_letter_queue = container.bus().names.dead_letters(CONSUMER)  # type: ignore[attr-defined]
    batch = HostileBatch(container, "rabbitmq")
    batch.add("unsigned", LEGIT_BODY, "unsigned", signed=False)
    connection = await aio_pika.connect(SERVICE_URLS["rabbitmq"])
    async with connection:
        channel = await connection.channel()
        await channel.queue_delete(dead_letter_queue)
        await publish_raw_rabbitmq(container, batch.messages)
        await asyncio.sleep(2.0)  # several 0.3 s retry cycles, every copy refused
        await channel.declare_queue(dead_letter_queue, durable=True)
    letters = await dead_letters_of(container, batch.messages, within=20)
    await container.worker().stop()
    assert list(letters) == [batch.messages[0].message_id]
    assert set((await LEFTOVERS["rabbitmq"](container)).values()) == {0}


# The largest message each broker accepts, made of headers or of body (bytes as the broker counts
# them): RabbitMQ's content-header frame (frame_max, 128 KiB) and max_message_size (128 MiB);
# JetStream's 64 KiB of headers and NATS's max_payload (1 MiB, headers included); Kafka's default
# message.max.bytes (1,048,588 for the record batch; tansu has no limit of its own). Redis has none
# at sizes a test can use (512 MB per entry): 1 MiB of headers and 16 MiB of body there.
LARGEST_HEADERS = {"rabbitmq": 131_072 - 1_200, "kafka": 1_040_000, "nats": 65_536 - 600, "redis": 1_048_576}
LARGEST_MESSAGE = {
    "rabbitmq": 134_217_728 - 4_096,  # the body alone counts
    "kafka": 1_048_588 - 200,  # the batch's and the record's own framing
    "nats": 1_048_576 - 128,  # the client adds Nats-Expected-Stream
    "redis": 16 * 1_048_576,
}
FOREIGN_HEADER_COUNT = 32  # what a copy keeps of other headers than the service's signed ones


def header_weight(transport: str, headers: dict[str, Any]) -> int:
    """A header block's size as ``transport`` counts it."""
    if transport == "rabbitmq":
        from pamqp.encode import field_table

        return len(field_table(headers))
    if transport == "nats":
        return 12 + sum(len(k) + len(v) + 4 for k, v in headers.items())
    return sum(len(k) + len(v) for k, v in headers.items())


def control_byte_headers(transport: str, base: dict[str, Any]) -> dict[str, Any]:
    """``base`` plus headers of ``\\x01`` bytes (each escaped to four characters on a copy), up to
    the largest block the broker accepts."""
    headers = dict(base)
    index = 0
    while True:
        candidate = headers | {f"x-h{index:05}": "\x01" * 100}
        if header_weight(transport, candidate) > LARGEST_HEADERS[transport]:
            return headers
        headers, index = candidate, index + 1


def largest_message(container: OutboxContainer, transport: str, shape: str) -> HostileBatch:
    batch = HostileBatch(container, transport)
    if shape == "headers":
        batch.add("largest-headers", LEGIT_BODY, "unsigned", signed=False)
        message = batch.messages[0]
        headers = control_byte_headers(transport, message.headers)
        batch.messages[0] = Hostile(message.label, message.body, headers, "unsigned", message.message_id)
    else:  # what room the message's few headers leave
        batch.add("largest-body", b"", "unsigned", signed=False)
        message = batch.messages[0]
        size = LARGEST_MESSAGE[transport]
        if transport in {"kafka", "nats"}:
            size -= header_weight(transport, message.headers)
        body = b"\x01" * size
        batch.messages[0] = Hostile(message.label, body, message.headers, "unsigned", message.message_id)
    return batch


def connection_of(container: OutboxContainer, transport: str) -> object:
    """The service's RabbitMQ connection's transport: a reconnect replaces it."""
    if transport != "rabbitmq":
        return None
    return container.bus().broker._connection.transport  # type: ignore[attr-defined]


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["headers", "body"])
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_the_largest_message_a_broker_accepts_is_dead_lettered_and_the_line_keeps_flowing(
    start: Start, transport: str, shape: str
) -> None:
    """A copy larger than the broker accepts used to be a connection error on RabbitMQ (the whole
    connection closed, the message came back, for ever), a refused copy on NATS (redelivered to
    max_deliver, then dropped) and a record the producer refused on Kafka (the consumer sought
    back for ever, the partition blocked). Now the copy is bounded: the hostile message ends in
    the dead-letter destination with its reason and what was left out, the legitimate messages
    around it are processed, nothing stays pending, and the connection stays up."""
    container, observer = await start(transport)
    connection = connection_of(container, transport)
    batch = largest_message(container, transport, shape)
    (hostile,) = batch.messages
    await PUBLISH_RAW[transport](container, batch.messages)
    legit = envelope(5)
    await container.bus().publish(legit)

    letters = await asyncio.wait_for(dead_letters_of(container, batch.messages, within=60), 90)
    await effects_become(container, ["consumed:5"], timeout=30)
    after = envelope(6)  # the line still flows, promptly
    await container.bus().publish(after)
    await effects_become(container, ["consumed:5", "consumed:6"], timeout=15)
    await asyncio.sleep(1.0)  # three redelivery delays: a message still cycling would show
    assert connection_of(container, transport) is connection  # RabbitMQ did not close it
    await container.worker().stop()

    assert list(letters) == [hostile.message_id]
    (letter,) = letters.values()
    assert letter.error.startswith("rejected: unsigned:"), letter.error
    truncated = letter.headers.get("x-truncated", "")
    if shape == "headers":
        copied = [name for name in letter.headers if name.startswith("x-h")]
        assert 0 < len(copied) <= FOREIGN_HEADER_COUNT
        assert "headers:" in truncated
        assert letter.body == hostile.body
    elif letter.body != hostile.body:  # cut to what the broker takes, and said so
        assert transport in {"kafka", "nats"}
        assert "body:" in truncated
        assert hostile.body.startswith(letter.body)
        assert len(letter.body) > len(hostile.body) // 2
    assert [seen["message_id"] for seen in observer.seen] == [legit.message_id, after.message_id]
    assert set((await LEFTOVERS[transport](container)).values()) == {0}


@pytest.mark.slow
@pytest.mark.kafka
@pytest.mark.parametrize("shape", ["headers", "body"])
async def test_a_kafka_retry_copy_of_the_largest_record_is_bounded(start: Start, shape: str) -> None:
    """A signed record whose handler fails is retried through a copy on the retry topic. Of the
    largest record Kafka accepts, that copy used to be refused by the producer, and the consumer
    sought back to the record instead, for ever (uncounted: the record never reached its dead
    letter). Now a copy of many headers keeps the signed ones: the record is retried, counted,
    and dead-lettered with the handler's error after the last attempt; a body that leaves no room
    for the retry's headers dead-letters the record at once (``retry_too_large``). The partition
    keeps flowing."""
    attempts = 3  # the start fixture's MESSAGE_BUS__MAX_DELIVERY_ATTEMPTS
    runs = attempts if shape == "headers" else 1
    container, observer = await start("kafka", failures=runs)
    batch = HostileBatch(container, "kafka")
    value = json.dumps({"counter_id": "c", "value": 7}).encode()
    if shape == "headers":
        batch.add("retried", value, "", extra=control_byte_headers("kafka", {}))
    else:  # JSON allows the padding; the signature covers it
        batch.add("retried", value + b" " * (LARGEST_MESSAGE["kafka"] - len(value) - 1_000), "")
    (record,) = batch.messages
    await PUBLISH_RAW["kafka"](container, batch.messages)
    letters = await asyncio.wait_for(dead_letters_of(container, batch.messages, within=60), 90)
    after = envelope(8)
    await container.bus().publish(after)
    await effects_become(container, ["consumed:8"], timeout=30)
    await container.worker().stop()

    assert list(letters) == [record.message_id]
    letter = letters[record.message_id]
    if shape == "headers":
        assert letter.error.startswith("RuntimeError: observer failure"), letter.error
        assert letter.headers["x-attempts"] == str(attempts)
    else:
        assert letter.error.startswith("retry_too_large:"), letter.error
    assert [seen["message_id"] for seen in observer.seen] == [record.message_id] * runs + [after.message_id]
    assert set((await LEFTOVERS["kafka"](container)).values()) == {0}
