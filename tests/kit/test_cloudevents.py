"""Events readable by services in other languages: every published message carries the CloudEvents
binary-mode attributes beside its signed headers, and the CloudEvents SDK reads the message as
the broker delivers it (RabbitMQ, NATS and Redis with ``ce-`` headers, Kafka with the Kafka
binding's ``ce_``)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aio_pika
import nats
import pytest
from aiokafka import AIOKafkaConsumer
from cloudevents.core.bindings import http, kafka, rabbitmq
from cloudevents.core.formats.json import JSONFormat
from faststream.redis.parser.binary import BinaryMessageFormatV1
from outbox_kit.application.context import CapturedContext
from outbox_kit.runtime.container import OutboxContainer
from outbox_kit.testing.fixtures import SERVICE_URLS, fresh_sqlite, kit_container, make_settings
from outbox_kit.testing.harness import CONSUMER, CounterChangedV1, install_kit
from outbox_kit.transports.base import FastStreamTransport
from outbox_kit.transports.envelope import Envelope
from redis.asyncio import Redis

pytestmark = pytest.mark.integration
EVENT = CounterChangedV1.message_name
OCCURRED = datetime(2026, 12, 6, 9, 30, 15, 250000, tzinfo=UTC)


async def ignore(_event: CounterChangedV1, _uow: object) -> None:
    return None


@pytest.fixture
async def broker_service(
    tmp_path: Path, sqlite_template: Path
) -> AsyncIterator[Callable[[str], Awaitable[OutboxContainer]]]:
    """A container on ``transport`` whose topology is declared and which consumes nothing, so
    what it publishes stays on the broker to be read raw."""
    started: list[OutboxContainer] = []

    async def start(transport: str) -> OutboxContainer:
        settings = make_settings(
            fresh_sqlite(tmp_path, sqlite_template),
            message_bus={"transport": transport, "url": SERVICE_URLS[transport]},
        )
        container = kit_container(settings)
        await install_kit(container)
        container.handlers().consume(CONSUMER, CounterChangedV1, ignore)
        await container.bus().start()
        started.append(container)
        return container

    yield start
    for container in started:
        await container.bus().delete_topology()  # type: ignore[attr-defined]
        await container.bus().stop()
        await container.database().dispose()


def envelope() -> Envelope:
    return Envelope(
        message_id=str(uuid.uuid4()),
        event_name=EVENT,
        occurred_on=OCCURRED,
        body=json.dumps({"counter_id": "c-1", "value": 7}).encode(),
        context=CapturedContext(
            tenant_id="acme",
            user_id="alice",
            user_roles="clerk",
            correlation_id="checkout-7",
            traceparent=None,
        ),
        ordering_key="c-1",
    )


def bus_of(container: OutboxContainer) -> FastStreamTransport:
    bus = container.bus()
    assert isinstance(bus, FastStreamTransport)
    return bus


def text(headers: dict[str, Any]) -> dict[str, str]:
    return {k: v.decode() if isinstance(v, bytes) else str(v) for k, v in headers.items()}


async def read_rabbitmq(container: OutboxContainer) -> Any:
    names = bus_of(container).names
    async with await aio_pika.connect(SERVICE_URLS["rabbitmq"]) as connection:
        channel = await connection.channel()
        queue = await channel.get_queue(names.queue(CONSUMER), ensure=False)
        message = await queue.get(timeout=10, fail=True)
        assert message is not None
        await message.ack()
    return rabbitmq.from_binary(
        rabbitmq.RabbitMQMessage(text(dict(message.headers)), message.content_type, message.body),
        JSONFormat(),
    )


async def read_kafka(container: OutboxContainer) -> Any:
    topic = bus_of(container).names.channel(EVENT)
    reader = AIOKafkaConsumer(topic, bootstrap_servers=SERVICE_URLS["kafka"], auto_offset_reset="earliest")
    await reader.start()
    try:
        record = await reader.getone()
    finally:
        await reader.stop()
    headers = {name: value for name, value in record.headers}
    return kafka.from_binary(kafka.KafkaMessage(headers, record.key, record.value), JSONFormat())


async def read_nats(container: OutboxContainer) -> Any:
    names = bus_of(container).names
    client = await nats.connect(SERVICE_URLS["nats"])
    try:
        message = await client.jetstream().get_last_msg(names.stream("events"), names.channel(EVENT))
    finally:
        await client.close()
    assert message.data is not None
    return http.from_binary(http.HTTPMessage(text(message.headers or {}), message.data), JSONFormat())


async def read_redis(container: OutboxContainer) -> Any:
    client = Redis.from_url(SERVICE_URLS["redis"])
    try:
        ((_, fields),) = await client.xrange(bus_of(container).names.channel(EVENT), count=1)
    finally:
        await client.aclose()
    body, headers = BinaryMessageFormatV1.parse(fields[b"__data__"])
    return http.from_binary(http.HTTPMessage(text(headers), body), JSONFormat())


READERS: dict[str, Callable[[OutboxContainer], Awaitable[Any]]] = {
    "rabbitmq": read_rabbitmq,
    "kafka": read_kafka,
    "nats": read_nats,
    "redis": read_redis,
}


@pytest.mark.parametrize(
    "transport",
    [
        pytest.param("rabbitmq", marks=pytest.mark.rabbitmq),
        pytest.param("kafka", marks=pytest.mark.kafka),
        pytest.param("nats", marks=pytest.mark.nats),
        pytest.param("redis", marks=pytest.mark.redis),
    ],
)
async def test_the_cloudevents_sdk_reads_a_published_event(
    broker_service: Callable[[str], Awaitable[OutboxContainer]], transport: str
) -> None:
    container = await broker_service(transport)
    sent = envelope()
    await container.bus().publish(sent)
    event = await READERS[transport](container)
    namespace = container.settings().application.namespace
    assert event.get_specversion() == "1.0"
    assert event.get_id() == sent.message_id
    assert event.get_type() == EVENT
    assert event.get_source() == f"/{namespace}"
    assert event.get_time() == OCCURRED
    assert event.get_extension("tenantid") == "acme"
    assert event.get_extension("correlationid") == "checkout-7"
    data = event.get_data()
    assert (json.loads(data) if isinstance(data, bytes | str) else data) == {"counter_id": "c-1", "value": 7}
