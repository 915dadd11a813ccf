"""Raw access to the four brokers for tests: hostile messages published past the service's
publisher (unsigned, malformed bodies, junk and forged headers, per what each broker can carry),
the consumer's dead-letter copies read back, and what a consumer left unacknowledged or pending
on its main and retry queues or streams. The kit's hostile-message tests and a service's
reliability tier share them; each reaches the broker at the container's own
``MESSAGE_BUS__URL``."""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, cast

import aio_pika
import nats
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from faststream.redis.parser.binary import BinaryMessageFormatV1
from redis.asyncio import Redis

from outbox_kit.runtime.container import OutboxContainer
from outbox_kit.testing.fixtures import TEST_SIGNING_KEYS
from outbox_kit.testing.harness import CONSUMER, CounterChangedV1
from outbox_kit.transports.base import FastStreamTransport
from outbox_kit.transports.copies import DeadLetterCopy
from outbox_kit.transports.envelope import SIGNATURE, USER_ROLES
from outbox_kit.transports.redis import Utf8BinaryMessageFormat


def _bus(container: OutboxContainer) -> FastStreamTransport:
    return cast("FastStreamTransport", container.bus())


def _url(container: OutboxContainer) -> str:
    return container.settings().message_bus.url


EVENT = CounterChangedV1.message_name
LEGIT_BODY = json.dumps({"counter_id": "c", "value": 99}).encode()
HUGE_INT_BODY = b'{"counter_id": "c", "value": ' + b"9" * 5000 + b"}"  # past int's 4300 digits
DEEP_BODY = b"[" * 100_000 + b"]" * 100_000  # RecursionError in json
LONG_VALUE = "y" * 10_000
HEADER_VALUE_LIMIT = 1024  # what a dead-letter copy keeps of one header value


class NonUtf8LongString(str):
    """An AMQP long-string header holding bytes that are not UTF-8, as a client in another
    language may send it (pamqp encodes a ``str`` through ``encode``; bytes it refuses)."""

    raw: bytes

    def __new__(cls, raw: bytes) -> NonUtf8LongString:
        value = super().__new__(cls, raw.decode("latin-1"))
        value.raw = raw
        return value

    def encode(self, encoding: str = "utf-8", errors: str = "strict") -> bytes:
        del encoding, errors
        return self.raw


@dataclass(frozen=True)
class Hostile:
    label: str
    body: bytes
    headers: dict[str, Any]
    reason: str
    message_id: str


@dataclass
class HostileBatch:
    """The hostile messages of one transport, built on the running container's signer."""

    container: OutboxContainer
    transport: str
    messages: list[Hostile] = field(default_factory=list)

    def add(
        self,
        label: str,
        body: bytes,
        reason: str,
        *,
        signed: bool = True,
        extra: dict[str, Any] | None = None,
        context: dict[str, str] | None = None,
    ) -> None:
        """``extra`` headers are added after signing (forged), ``context`` ones before (signed)."""
        message_id = f"{label}-{uuid.uuid4().hex[:8]}"
        headers = {
            "x-message-id": message_id,
            "x-event-name": EVENT,
            "x-occurred-on": datetime.now(UTC).isoformat(),
        } | (context or {})
        if signed:
            headers = self.container.signer().sign(headers, body)
        self.messages.append(Hostile(label, body, headers | (extra or {}), reason, message_id))


def hostile_messages(container: OutboxContainer, transport: str) -> HostileBatch:
    batch = HostileBatch(container, transport)
    batch.add("unsigned-huge-int", HUGE_INT_BODY, "unsigned", signed=False)
    batch.add("huge-int", HUGE_INT_BODY, "malformed_body")
    batch.add("deep", DEEP_BODY, "malformed_body")
    junk: dict[str, Any] = {"x-nul": "a\x00b", "x-long": LONG_VALUE, "x-newline": "a\r\nforged: yes"}
    if transport == "nats":
        junk = {"x-long": LONG_VALUE}  # NATS header values are single-line text by protocol
    if transport == "rabbitmq":
        junk |= {"x-junk": NonUtf8LongString(b"\xff\xfe not UTF-8"), "x-bytes": bytearray(b"\x00\xff")}
    batch.add("junk-headers", LEGIT_BODY, "unsigned", signed=False, extra=junk)
    # A known key id and a non-ASCII digest: a bad signature like any other (it once raised).
    ((key_id, _),) = TEST_SIGNING_KEYS.items()
    batch.add("non-ascii-signature", LEGIT_BODY, "bad_signature", extra={SIGNATURE: f"{key_id}:\u00e9\u00e9"})
    # Signed by another producer: roles the stored, comma-joined form would change are refused at
    # the door, not by the consumer's commit after the handler ran (retried, then dead-lettered).
    roles = {USER_ROLES: "clerk, admin"}
    batch.add("roles-storage-would-change", LEGIT_BODY, "malformed_header", context=roles)
    if transport == "rabbitmq":  # counters the broker writes; forged here
        batch.add("forged-x-death", LEGIT_BODY, "malformed_header", extra={"x-death": "garbage"})
        batch.add("forged-delivery-count", LEGIT_BODY, "malformed_header", extra={"x-delivery-count": "abc"})
    if transport == "kafka":  # the attempt counter this service writes on a retry copy; forged here
        batch.add("forged-attempt", LEGIT_BODY, "malformed_header", extra={"x-attempt": "abc"})
        # Kafka header values are any bytes, or null.
        batch.add(
            "raw-bytes-headers",
            LEGIT_BODY,
            "unsigned",
            signed=False,
            extra={"x-junk": b"\xff\xfe", "x-null": None},
        )
    return batch


async def publish_raw_rabbitmq(container: OutboxContainer, messages: list[Hostile]) -> None:
    names = _bus(container).names
    connection = await aio_pika.connect(_url(container))
    async with connection:
        channel = await connection.channel()
        exchange = await channel.get_exchange(names.exchange(), ensure=False)
        for message in messages:
            await exchange.publish(
                aio_pika.Message(message.body, headers=message.headers), routing_key=names.channel(EVENT)
            )


async def publish_raw_nats(container: OutboxContainer, messages: list[Hostile]) -> None:
    names = _bus(container).names
    client = await nats.connect(_url(container))
    try:
        js = client.jetstream()
        for message in messages:
            await js.publish(
                names.channel(EVENT), message.body, headers=message.headers, stream=names.stream("events")
            )
    finally:
        await client.close()


async def publish_raw_redis(container: OutboxContainer, messages: list[Hostile]) -> None:
    """Entries in FastStream's binary format; the junk headers in its legacy JSON form, which
    carries any JSON value as a header; one more entry whose JSON ``headers`` is no object."""
    bus = _bus(container)
    client = bus.broker.config.connection.client
    stream = bus.names.channel(EVENT)
    for message in messages:
        if message.label == "junk-headers":
            legacy = {"data": message.body.decode(), "headers": message.headers | {"x-nested": {"a": [1]}}}
            data = json.dumps(legacy).encode()
        else:  # the service's own format: FastStream's miscounts non-ASCII headers (redis.py)
            data = await Utf8BinaryMessageFormat.encode(
                message=message.body, reply_to=None, headers=message.headers, correlation_id="raw"
            )
        await client.xadd(stream, {"__data__": data})


async def publish_raw_kafka(container: OutboxContainer, messages: list[Hostile]) -> None:
    names = _bus(container).names
    producer = AIOKafkaProducer(bootstrap_servers=_url(container), max_request_size=4_000_000)
    await producer.start()
    try:
        for message in messages:
            headers = [
                (name, value if value is None or isinstance(value, bytes) else str(value).encode())
                for name, value in message.headers.items()
            ]
            await producer.send_and_wait(names.channel(EVENT), message.body, headers=headers)
    finally:
        await producer.stop()


PUBLISH_RAW: dict[str, Callable[[OutboxContainer, list[Hostile]], Awaitable[None]]] = {
    "rabbitmq": publish_raw_rabbitmq,
    "kafka": publish_raw_kafka,
    "nats": publish_raw_nats,
    "redis": publish_raw_redis,
}


def redis_only_messages(batch: HostileBatch) -> None:
    """What only Redis can carry: a header value that is not UTF-8 (FastStream then drops every
    header of the entry), and a legacy envelope whose ``headers`` is a list (FastStream's parser
    fails on it)."""
    batch.add("non-utf8-header", LEGIT_BODY, "unsigned", signed=False, extra={"x-junk": b"\xff\xfe"})
    batch.add("headers-list", LEGIT_BODY, "unsigned", signed=False)


async def publish_redis_only(container: OutboxContainer, messages: list[Hostile]) -> None:
    bus = _bus(container)
    client = bus.broker.config.connection.client
    stream = bus.names.channel(EVENT)
    for message in messages:
        if message.label == "headers-list":
            data = json.dumps(
                {"data": f"{message.message_id} body", "headers": [message.message_id]}
            ).encode()
        else:
            data = await BinaryMessageFormatV1.encode(
                message=message.body, reply_to=None, headers=message.headers, correlation_id="raw"
            )
        await client.xadd(stream, {"__data__": data})


def identify(letter: DeadLetterCopy, messages: list[Hostile]) -> str | None:
    """The hostile message a dead letter is a copy of: by its id header, or by its body where the
    transport could not read the headers (the raw entry, id included, became the body)."""
    by_header = letter.headers.get("x-message-id")
    if by_header:
        return by_header
    return next((m.message_id for m in messages if m.message_id.encode() in letter.body), None)


async def dead_letters_of(
    container: OutboxContainer, messages: list[Hostile], within: float, expected: int | None = None
) -> dict[str, DeadLetterCopy]:
    """The consumer's dead letters by message id, once ``expected`` (default: one per message)
    arrived or ``within`` seconds passed."""
    found: dict[str, DeadLetterCopy] = {}
    wanted = len(messages) if expected is None else expected
    deadline = time.monotonic() + within
    while len(found) < wanted and time.monotonic() < deadline:
        for letter in await _bus(container).dead_letters(CONSUMER):
            key = identify(letter, messages)
            found[key or f"unidentified-{len(found)}"] = letter
        await asyncio.sleep(0.2)
    return found


async def rabbitmq_leftovers(container: OutboxContainer) -> dict[str, int]:
    """Messages left on the main and retry queues once the consumer is gone. A message the service
    never acknowledged is requeued when its channel closes, so it is counted here as ready: no
    management plugin needed to see unacked ones."""
    names = _bus(container).names
    connection = await aio_pika.connect(_url(container))
    async with connection:
        channel = await connection.channel()
        counts: dict[str, int] = {}
        for name in (names.queue(CONSUMER), names.retry_queue(CONSUMER)):
            queue = await channel.declare_queue(name, passive=True)
            counts[name] = queue.declaration_result.message_count or 0
        return counts


async def nats_leftovers(container: OutboxContainer) -> dict[str, int]:
    names = _bus(container).names
    client = await nats.connect(_url(container))
    try:
        durable = re.sub(r"[^A-Za-z0-9_-]", "_", names.queue(CONSUMER))
        info = await client.jetstream().consumer_info(names.stream("events"), durable)
        return {"num_ack_pending": info.num_ack_pending, "num_pending": info.num_pending}
    finally:
        await client.close()


async def redis_leftovers(container: OutboxContainer) -> dict[str, int]:
    names = _bus(container).names
    client = Redis.from_url(_url(container))
    try:
        stream, group = names.channel(EVENT), names.queue(CONSUMER)
        pending = await client.xpending(stream, group)
        (info,) = [g for g in await client.xinfo_groups(stream) if g["name"].decode() == group]
        return {"pending": pending["pending"], "lag": info["lag"]}
    finally:
        await client.aclose()


async def kafka_leftovers(container: OutboxContainer) -> dict[str, int]:
    """Records of the main and retry topics past the consumer group's committed offsets (Kafka
    acknowledges by committing an offset: a record left behind is one never acknowledged)."""
    names = _bus(container).names
    topics = (names.channel(EVENT), names.retry_queue(CONSUMER))
    # A member of the group that subscribes to nothing: it only reads the group's offsets.
    reader = AIOKafkaConsumer(bootstrap_servers=_url(container), group_id=names.queue(CONSUMER))
    await reader.start()
    try:
        await reader.topics()
        partitions = [
            TopicPartition(topic, p) for topic in topics for p in reader.partitions_for_topic(topic) or ()
        ]
        if {tp.topic for tp in partitions} != set(topics):  # or nothing would be counted
            msg = f"Kafka knows no partitions of {sorted(set(topics) - {tp.topic for tp in partitions})}"
            raise AssertionError(msg)
        for _ in range(60):  # up to 30 s: a loaded broker catches up slowly
            ends = await reader.end_offsets(partitions)
            left = dict.fromkeys(topics, 0)
            for tp, end in ends.items():
                # A committed offset past the end (tansu reports it for a partition now and then,
                # even for many seconds) leaves no record unacknowledged: it counts as none, per
                # partition, so it cannot hide another partition's leftover.
                left[tp.topic] += max(0, end - (await reader.committed(tp) or 0))
            if not any(left.values()):
                break
            await asyncio.sleep(0.5)
    finally:
        await reader.stop()
    return left


LEFTOVERS: dict[str, Callable[[OutboxContainer], Awaitable[dict[str, int]]]] = {
    "rabbitmq": rabbitmq_leftovers,
    "kafka": kafka_leftovers,
    "nats": nats_leftovers,
    "redis": redis_leftovers,
}
