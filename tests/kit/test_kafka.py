"""Kafka specifics on a real Kafka-protocol broker (``TEST_KAFKA_URL``): topics the service
declares, the ordering key as the record key, dead letters read back without consuming them, and
offsets committed only after the handler, so a stopped consumer's unfinished record is read again.

The behaviour every broker shares (context, retries, dead letters, hostile input) is in
tests/integration/test_brokers.py and test_hostile_messages.py, parametrized over Kafka too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from typing import Any, cast

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from outbox_kit.testing.fixtures import SERVICE_URLS, eventually
from outbox_kit.testing.harness import CounterChangedV1
from outbox_kit.transports.kafka import KafkaTransport
from test_brokers import CONSUMER, Start, effects_become, effects_of, envelope
from test_brokers import start as start  # the fixture  # noqa: PLC0414

pytestmark = [pytest.mark.integration, pytest.mark.kafka]
KAFKA = SERVICE_URLS["kafka"]


async def partitions_of(topics: list[str]) -> dict[str, dict[int, int]]:
    """Each topic's partitions with their end offsets (records written so far)."""
    reader = AIOKafkaConsumer(bootstrap_servers=KAFKA)
    await reader.start()
    try:
        known = await reader.topics()
        found: dict[str, dict[int, int]] = {}
        for topic in topics:
            if topic in known:
                partitions = [TopicPartition(topic, p) for p in reader.partitions_for_topic(topic) or ()]
                ends = await reader.end_offsets(partitions)
                found[topic] = {tp.partition: end for tp, end in ends.items()}
        return found
    finally:
        await reader.stop()


async def test_the_service_declares_its_topics_and_leaves_existing_ones_alone(start: Start) -> None:
    """Every published, consumed, retry and dead-letter topic exists with the configured number
    of partitions; a topic that existed before keeps its own; declaring again changes nothing."""
    namespace = f"t{uuid.uuid4().hex[:10]}"
    existing = f"{namespace}.kit.counter-changed.v1"
    admin = AIOKafkaAdminClient(bootstrap_servers=KAFKA)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(existing, 1, 1)])
    finally:
        await admin.close()
    container, _ = await start("kafka", namespace=namespace)
    transport = cast("KafkaTransport", container.bus())
    consumers = container.handlers().consumers
    wanted = transport.topics(consumers)
    names = container.bus().names  # type: ignore[attr-defined]
    assert {names.retry_queue(CONSUMER), names.dead_letters(CONSUMER), existing} <= set(wanted)
    declared = await partitions_of(wanted)
    assert sorted(declared) == sorted(wanted)
    assert {topic: len(p) for topic, p in declared.items() if topic != existing} == dict.fromkeys(
        set(wanted) - {existing}, 3
    )
    assert len(declared[existing]) == 1
    await transport.declare(consumers)  # a second replica starting: nothing to create, no error
    assert await partitions_of(wanted) == declared


async def test_one_ordering_key_stays_on_one_partition_in_order(start: Start) -> None:
    container, observer = await start("kafka")
    bus = container.bus()
    for value in range(6):
        await bus.publish(dataclasses.replace(envelope(value), ordering_key="counter-7"))
    await eventually(lambda: len(observer.seen) == 6)
    assert [seen["value"] for seen in observer.seen] == list(range(6))
    topic = bus.names.channel(CounterChangedV1.message_name)  # type: ignore[attr-defined]
    written = (await partitions_of([topic]))[topic]
    assert sorted(written.values()) == [0, 0, 6]  # every record of the key on one partition


async def test_dead_letters_are_read_oldest_first_and_stay_on_the_topic(start: Start) -> None:
    container, _ = await start("kafka")
    dead_letters = container.bus().names.dead_letters(CONSUMER)  # type: ignore[attr-defined]
    producer = AIOKafkaProducer(bootstrap_servers=KAFKA)
    await producer.start()
    try:
        for number in range(5):  # keys spread the copies over the partitions
            await producer.send_and_wait(
                dead_letters,
                f"body-{number}".encode(),
                key=f"key-{number}".encode(),
                headers=[("x-message-id", f"m-{number}".encode()), ("x-error", b"boom"), ("x-null", None)],
            )
            await asyncio.sleep(0.01)  # "oldest" across partitions is by timestamp (milliseconds)
    finally:
        await producer.stop()
    assert len([n for n in (await partitions_of([dead_letters]))[dead_letters].values() if n]) > 1
    bus: Any = container.bus()
    first_three = await bus.dead_letters(CONSUMER, limit=3)
    assert [letter.headers["x-message-id"] for letter in first_three] == ["m-0", "m-1", "m-2"]
    assert [letter.body for letter in first_three] == [b"body-0", b"body-1", b"body-2"]
    assert first_three[0].error == "boom"
    assert first_three[0].headers["x-null"] == ""
    everything = await bus.dead_letters(CONSUMER)
    assert [letter.headers["x-message-id"] for letter in everything] == [f"m-{n}" for n in range(5)]


async def test_a_record_whose_handler_never_finished_is_read_again_after_a_restart(start: Start) -> None:
    """Offsets are committed only after the handler: a consumer stopped mid-handler (a deploy, a
    crash) committed nothing for that record, so the next member of the group reads it again and
    the effect happens once."""
    namespace = f"t{uuid.uuid4().hex[:10]}"
    first, stuck = await start("kafka", namespace=namespace)
    stuck.takes_seconds = 3600
    # FastStream gives a running handler 15 s to finish on stop; this one never would.
    first.bus().broker.config.broker_config.graceful_timeout = 0.5  # type: ignore[attr-defined]
    message = envelope(12)
    await first.bus().publish(message)
    await eventually(lambda: len(stuck.seen) == 1)
    await asyncio.wait_for(first.worker().stop(), 30)
    assert await effects_of(first) == []
    second, observer = await start("kafka", namespace=namespace)
    await effects_become(second, ["consumed:12"], timeout=30)
    assert [seen["message_id"] for seen in observer.seen] == [message.message_id]


async def test_the_consumer_group_session_is_the_setting(start: Start) -> None:
    """``MESSAGE_BUS__KAFKA_SESSION_TIMEOUT_SECONDS`` reaches every consumer the service runs (the
    main topic's and the retry topic's), heartbeats every third of it; the test settings use 6 s."""
    container, _ = await start("kafka")
    assert container.settings().message_bus.kafka_session_timeout_seconds == 6.0
    consumers = [subscriber.consumer for subscriber in container.bus().broker.subscribers]  # type: ignore[attr-defined]
    assert len(consumers) == 2
    assert [(c._session_timeout_ms, c._heartbeat_interval_ms) for c in consumers] == [(6000, 2000)] * 2
