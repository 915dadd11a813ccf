"""The FastStream transport for all four brokers, on FastStream's in-memory test brokers.

Fast, and runs without any broker. Redelivery timing, dead-letter destinations and crash
behaviour need real brokers: see tests/integration/test_brokers.py (Kafka included, against
``TEST_KAFKA_URL``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka.errors import KafkaConnectionError
from aiokafka.structs import ConsumerRecord
from faststream.kafka import TestKafkaBroker
from faststream.nats import TestNatsBroker
from faststream.rabbit import TestRabbitBroker
from faststream.redis import TestRedisBroker
from outbox_kit.application.context import capture_context
from outbox_kit.application.handlers import HandlerRegistry
from outbox_kit.application.messages import (
    MessageRegistry,
)
from outbox_kit.persistence.unit_of_work import SqlUnitOfWork
from outbox_kit.runtime.container import OutboxContainer
from outbox_kit.testing.fixtures import acting_as, kit_container, make_settings
from outbox_kit.testing.harness import CounterChangedV1, effects, install_kit, record_effect
from outbox_kit.transports.envelope import Envelope, Signer
from outbox_kit.transports.kafka import (
    ATTEMPT,
    NOT_BEFORE,
    KafkaDelivery,
    KafkaTopologyError,
    KafkaTransport,
)
from outbox_kit.transports.received import the_message
from outbox_kit.transports.settings import (
    EndpointNames,
)

pytestmark = pytest.mark.unit
TEST_BROKERS: dict[str, Any] = {
    "rabbitmq": TestRabbitBroker,
    "kafka": TestKafkaBroker,
    "nats": TestNatsBroker,
    "redis": TestRedisBroker,
}


def capture_dead_letters(container: OutboxContainer, transport: str) -> list[dict[str, str]]:
    """Subscribe to the consumer's dead-letter destination (test brokers need a subscriber)."""
    bus = container.bus()
    names, broker, captured = bus.names, bus.broker, []  # type: ignore[attr-defined]

    async def collect(message: Any) -> None:
        captured.append({k: str(v) for k, v in (message.headers or {}).items()})

    # A dead letter's body may be anything: the message itself, as the kit's subscribers take it
    # (the brokers run without FastStream's dependency injection).
    raw = {"decoder": the_message}
    if transport == "nats":
        from faststream.nats import JStream

        subscriber = broker.subscriber(
            names.dead_letter_subject("kit.observer"),
            stream=JStream(names.stream("dead_letters"), declare=False),
            **raw,
        )
    elif transport == "redis":
        subscriber = broker.subscriber(stream=names.dead_letters("kit.observer"), **raw)
    else:
        subscriber = broker.subscriber(names.dead_letters("kit.observer"), **raw)
    subscriber(collect)
    return captured


class Observer:
    def __init__(self, failures: int = 0) -> None:
        self.failures = failures
        self.seen: list[tuple[str | None, str | None]] = []

    async def __call__(self, event: CounterChangedV1, uow: SqlUnitOfWork) -> None:
        from outbox_kit.application.context import (
            current_context,
        )

        self.seen.append((current_context().tenant_id, current_context().authentication_type))
        if self.failures:
            self.failures -= 1
            msg = "observer fails"
            raise RuntimeError(msg)
        await record_effect(uow, f"consumed:{event.value}")


@asynccontextmanager
async def in_memory(
    transport: str, sqlite_url: str, failures: int = 0, **sections: dict[str, Any]
) -> AsyncIterator[tuple[OutboxContainer, Observer]]:
    container = kit_container(
        make_settings(
            sqlite_url,
            message_bus={
                "transport": transport,
                "url": "",
                "max_delivery_attempts": 3,
                "redelivery_delay_seconds": 0.01,
            },
            **sections,
        )
    )
    await install_kit(container)
    observer = Observer(failures)
    container.handlers().consume("kit.observer", CounterChangedV1, observer)
    container.dead_letters = capture_dead_letters(container, transport)  # type: ignore[attr-defined]
    try:
        async with TEST_BROKERS[transport](container.bus().broker):
            yield container, observer
    finally:
        await container.database().dispose()


def envelope(value: int, message_id: str | None = None) -> Envelope:
    with acting_as(tenant="globex", user="bob"):
        context = capture_context()
    body = json.dumps(CounterChangedV1(counter_id="c", value=value).model_dump(mode="json")).encode()
    return Envelope(
        message_id or str(uuid.uuid4()), "kit.counter-changed.v1", datetime.now(UTC), body, context
    )


async def consumed(container: OutboxContainer) -> list[str]:
    async with container.database().session() as session:
        return await effects(session)


@pytest.mark.parametrize("transport", TEST_BROKERS)
async def test_a_message_is_consumed_once_under_the_senders_context(transport: str, sqlite_url: str) -> None:
    async with in_memory(transport, sqlite_url) as (container, observer):
        message = envelope(1)
        await container.bus().publish(message)
        await container.bus().publish(message)
        assert await consumed(container) == ["consumed:1"]
        assert observer.seen == [("globex", "message")]
        assert container.metrics().inbox_duplicates.labels("kit.observer")._value.get() == 1


@pytest.mark.parametrize("transport", TEST_BROKERS)
async def test_a_forged_message_is_rejected_without_running_the_handler(
    transport: str, sqlite_url: str
) -> None:
    async with in_memory(transport, sqlite_url) as (container, observer):
        forged = envelope(9)
        forger = Signer({"test": "wrong"}, "test", allow_unsigned=False)
        await container.bus().send(forged, forger.sign(forged.headers(), forged.body))  # type: ignore[attr-defined]
        assert observer.seen == []
        rejected = container.metrics().inbox_rejected.labels("kit.observer", "bad_signature")
        assert rejected._value.get() == 1
        (letter,) = container.dead_letters  # type: ignore[attr-defined]
        assert letter["x-message-id"] == forged.message_id
        assert "bad_signature" in letter["x-error"]


@pytest.mark.parametrize("transport", TEST_BROKERS)
async def test_a_failure_rolls_back_the_inbox_row_and_effects(transport: str, sqlite_url: str) -> None:
    async with in_memory(transport, sqlite_url, failures=1) as (container, observer):
        await container.bus().publish(envelope(2))
        if transport == "kafka":  # redelivered through the retry topic, inline under the test broker
            assert len(observer.seen) == 2
            assert await consumed(container) == ["consumed:2"]
        else:  # the broker redelivers later (real-broker tests prove it); nothing was kept
            assert len(observer.seen) == 1
            assert await consumed(container) == []
        assert container.metrics().inbox_failures.labels("kit.observer")._value.get() == 1


async def test_kafka_dead_letters_after_the_last_attempt(sqlite_url: str) -> None:
    async with in_memory("kafka", sqlite_url, failures=99) as (container, observer):
        message = envelope(3)
        await container.bus().publish(message)
        assert len(observer.seen) == 3
        assert await consumed(container) == []
        (letter,) = container.dead_letters  # type: ignore[attr-defined]
        assert (letter["x-message-id"], letter["x-attempts"]) == (message.message_id, "3")
        assert "RuntimeError: observer fails" in letter["x-error"]


@dataclass
class RecordedKafkaMessage:
    """The parts of a FastStream Kafka message a delivery touches, recording ack and nack."""

    headers: dict[str, str]
    body: bytes = b"{}"
    raw_message: object = None
    calls: list[str] = field(default_factory=list)

    async def ack(self) -> None:
        self.calls.append("ack")

    async def nack(self) -> None:
        self.calls.append("nack")


class RefusingKafkaBroker:
    async def publish(self, *args: object, **kwargs: object) -> None:
        del args, kwargs
        msg = "the cluster refused the copy"
        raise KafkaConnectionError(msg)


@pytest.mark.parametrize("step", ["retry", "dead_letter"])
async def test_a_kafka_copy_that_cannot_be_published_is_read_again_not_committed(step: str) -> None:
    """Kafka commits offsets: committing past a message whose retry or dead-letter copy was refused
    would lose it. The delivery seeks back (nack) and raises instead."""
    message = RecordedKafkaMessage(headers={"x-message-id": "m-1"})
    delivery = KafkaDelivery(
        message,  # type: ignore[arg-type]
        RefusingKafkaBroker(),  # type: ignore[arg-type]
        topic="shop.kit.counter-changed.v1",
        retry_topic="shop.consumer.kit.retry",
        dlq="shop.consumer.kit.dlq",
        delay=0.1,
    )
    forward = delivery.retry(1) if step == "retry" else delivery.dead_letter("boom", 3)
    with pytest.raises(KafkaConnectionError):
        await forward
    assert message.calls == ["nack"]


@dataclass
class FakeKafkaAdmin:
    """Stands in for aiokafka's admin client: a set of topics and a scripted answer."""

    existing: set[str]
    refuse: dict[str, int] = field(default_factory=dict)
    created: list[tuple[str, int, int]] = field(default_factory=list)
    closed: bool = False

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        self.closed = True

    async def list_topics(self) -> list[str]:
        return sorted(self.existing)

    async def create_topics(self, new_topics: list[Any]) -> Any:
        self.created += [(t.name, t.num_partitions, t.replication_factor) for t in new_topics]
        errors = [
            (t.name, self.refuse.get(t.name, 0), "policy" if t.name in self.refuse else None)
            for t in new_topics
        ]
        return SimpleNamespace(topic_errors=errors)


def kafka_transport(admin: FakeKafkaAdmin, **bus: Any) -> tuple[KafkaTransport, list[Any]]:
    settings = make_settings(
        "sqlite+aiosqlite://",
        application={"namespace": "shop"},
        message_bus={"transport": "kafka", "kafka_topic_partitions": 6, "kafka_replication_factor": 3, **bus},
    ).message_bus
    registry = MessageRegistry()
    registry.register(CounterChangedV1)
    handlers = HandlerRegistry()

    async def observe(event: CounterChangedV1, uow: SqlUnitOfWork) -> None:
        del event, uow

    handlers.consume("kit.observer", CounterChangedV1, observe)
    transport = KafkaTransport(
        settings,
        EndpointNames("shop"),
        registry,
        Signer({}, None, allow_unsigned=True),
        admin=lambda _servers: admin,
    )
    return transport, list(handlers.consumers)


async def test_kafka_topics_are_declared_only_where_missing() -> None:
    admin = FakeKafkaAdmin(existing={"shop.kit.counter-changed.v1"})
    transport, consumers = kafka_transport(admin)
    await transport.declare(consumers)
    assert admin.created == [
        ("shop.consumer.kit.observer.dlq", 6, 3),
        ("shop.consumer.kit.observer.retry", 6, 3),
    ]
    assert admin.closed


async def test_a_refused_kafka_topic_is_a_clear_start_up_error() -> None:
    admin = FakeKafkaAdmin(existing=set(), refuse={"shop.consumer.kit.observer.retry": 38})
    transport, consumers = kafka_transport(admin)
    refused = r"shop\.consumer\.kit\.observer\.retry \(error 38: policy\)"
    with pytest.raises(KafkaTopologyError, match=refused):
        await transport.declare(consumers)
    assert admin.closed


async def test_kafka_topics_owned_by_the_platform_are_left_alone() -> None:
    admin = FakeKafkaAdmin(existing=set())
    transport, consumers = kafka_transport(admin, kafka_create_topics=False)
    await transport.declare(consumers)
    assert admin.created == []


UNREADABLE_BODIES = {
    "huge-int": b'{"counter_id": "c", "value": ' + b"9" * 5000 + b"}",  # past int's 4300 digits
    "deep": b"[" * 100_000 + b"]" * 100_000,  # RecursionError in json
}


@pytest.mark.parametrize("transport", TEST_BROKERS)
@pytest.mark.parametrize("body", UNREADABLE_BODIES.values(), ids=UNREADABLE_BODIES.keys())
async def test_a_signed_but_unreadable_body_is_dead_lettered_as_malformed(
    transport: str, body: bytes, sqlite_url: str
) -> None:
    """FastStream does not decode the body (it raised before the service saw the message); the
    pipeline does, and an unreadable body is a rejection with its reason (Kafka included)."""
    async with in_memory(transport, sqlite_url) as (container, observer):
        message = dataclasses.replace(envelope(1), body=body)
        signed = container.signer().sign(message.headers(), body)
        await container.bus().send(message, signed)  # type: ignore[attr-defined]
        assert observer.seen == []
        (letter,) = container.dead_letters  # type: ignore[attr-defined]
        assert letter["x-message-id"] == message.message_id
        assert letter["x-error"].startswith("rejected: malformed_body: the body is not readable JSON")
        rejected = container.metrics().inbox_rejected.labels("kit.observer", "malformed_body")
        assert rejected._value.get() == 1


@pytest.mark.parametrize("attempt", ["abc", "-1", "9" * 30])
async def test_a_forged_kafka_attempt_header_is_rejected_not_crashed_on(
    attempt: str, sqlite_url: str
) -> None:
    """``x-attempt`` is this service's own counter on Kafka; a value it never writes could not
    bound the retries, so the message is rejected (``malformed_header``), never processed."""
    async with in_memory("kafka", sqlite_url) as (container, observer):
        message = envelope(4)
        headers = container.signer().sign(message.headers(), message.body) | {ATTEMPT: attempt}
        await container.bus().send(message, headers)  # type: ignore[attr-defined]
        assert observer.seen == []
        (letter,) = container.dead_letters  # type: ignore[attr-defined]
        assert letter["x-error"].startswith(f"rejected: malformed_header: {ATTEMPT} is not a delivery count")


@pytest.mark.parametrize("not_before", ["inf", "abc", "nan", "1e300"])
async def test_a_forged_kafka_retry_time_neither_crashes_nor_blocks_the_partition(
    not_before: str, sqlite_url: str
) -> None:
    """A retry copy's ``x-not-before`` that this service never writes (not a number, infinite,
    centuries away) is waited for at most as long as the longest real backoff."""
    async with in_memory("kafka", sqlite_url) as (container, observer):
        bus = container.bus()
        message = envelope(5)
        headers = container.signer().sign(message.headers(), message.body)
        retry_topic = bus.names.retry_queue("kit.observer")  # type: ignore[attr-defined]
        forged = headers | {ATTEMPT: "2", NOT_BEFORE: not_before}
        await asyncio.wait_for(bus.broker.publish(message.body, retry_topic, headers=forged), 10)  # type: ignore[attr-defined]
        assert observer.seen == [("globex", "message")]
        assert await consumed(container) == ["consumed:5"]


def occurred(days_ago: float, value: int) -> Envelope:
    return dataclasses.replace(envelope(value), occurred_on=datetime.now(UTC) - timedelta(days=days_ago))


@pytest.mark.parametrize("transport", TEST_BROKERS)
async def test_a_message_older_than_the_inbox_retention_is_dead_lettered_as_stale(
    transport: str, sqlite_url: str
) -> None:
    """Its inbox record may already be purged, so a replay could no longer be recognised as a
    duplicate: a correctly signed message that old is dead-lettered (``stale``), never handled."""
    async with in_memory(transport, sqlite_url, inbox={"retention_days": 7}) as (container, observer):
        stale, recent = occurred(7 + 1 / 24, 1), occurred(7 - 1 / 24, 2)
        await container.bus().publish(stale)
        await container.bus().publish(recent)
        assert await consumed(container) == ["consumed:2"]
        assert len(observer.seen) == 1
        (letter,) = container.dead_letters  # type: ignore[attr-defined]
        assert letter["x-message-id"] == stale.message_id
        assert letter["x-error"].startswith("rejected: stale: ")
        assert container.metrics().inbox_rejected.labels("kit.observer", "stale")._value.get() == 1


async def test_an_inbox_that_is_never_purged_accepts_a_message_of_any_age(sqlite_url: str) -> None:
    async with in_memory("rabbitmq", sqlite_url, inbox={"retention_days": 0}) as (container, observer):
        await container.bus().publish(occurred(3650, 3))
        assert await consumed(container) == ["consumed:3"]
        assert len(observer.seen) == 1
        assert container.dead_letters == []  # type: ignore[attr-defined]


async def test_a_kafka_record_whose_headers_are_not_text_is_dead_lettered(sqlite_url: str) -> None:
    """FastStream's Kafka parser decodes every header value as UTF-8 before the handler runs; a
    value that is not UTF-8, or a null one (Kafka allows both), raised there, and the record was
    never acknowledged. It is read with those values made text, and dead-lettered."""
    async with in_memory("kafka", sqlite_url) as (container, observer):
        bus = container.bus()
        topic = bus.names.channel(CounterChangedV1.message_name)  # type: ignore[attr-defined]
        message = envelope(8)
        headers = [("x-message-id", message.message_id.encode()), ("x-junk", b"\xff\xfe"), ("x-null", None)]
        record = ConsumerRecord(
            topic=topic,
            partition=0,
            offset=0,
            timestamp=0,
            timestamp_type=0,
            key=None,
            value=message.body,
            checksum=None,
            serialized_key_size=0,
            serialized_value_size=len(message.body),
            headers=headers,
        )
        subscribers = bus.broker.subscribers  # type: ignore[attr-defined]
        (subscriber,) = [s for s in subscribers if topic in {t.name for t in s.topics}]
        await subscriber.process_message(record)
        assert observer.seen == []
        (letter,) = container.dead_letters  # type: ignore[attr-defined]
        assert (letter["x-message-id"], letter["x-junk"], letter["x-null"]) == (
            message.message_id,
            r"\xff\xfe",
            "",
        )
        assert letter["x-error"].startswith("rejected: unsigned: ")
