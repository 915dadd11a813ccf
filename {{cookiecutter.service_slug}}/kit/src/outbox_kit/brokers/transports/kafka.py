"""Kafka: one topic per event, one consumer group per consumer, retry and dead-letter topics.

Kafka has no redelivery count and FastStream's default ack policy commits *before* the handler
runs, so a failed message would be lost. Here the handler runs with a manual ack; a failure is
republished to ``<group>.retry`` with ``x-attempt`` and ``x-not-before`` and only then committed;
the retry subscriber waits until ``x-not-before`` (never longer than the longest backoff this
service writes, and not at all for a value it never writes: anyone who can write the retry topic
could otherwise stall its partition for ever) and runs the same wrapper; the last failure goes
to ``<group>.dlq``. The ordering key is the Kafka key, so one key stays on one partition.

FastStream's parser decodes every header value as UTF-8 before the handler runs; Kafka allows
any bytes and null values, which raised there (the record was never acknowledged, and the
partition's next commit passed over it). Such values are read as escaped text instead, and the
wrapper rejects or handles the record like any other.

Kafka commits offsets, not messages: once a later message of the partition is committed, an
earlier one that was never acknowledged is gone. So when the retry or dead-letter copy cannot be
published (the broker is failing), the consumer seeks back to the message (``nack``) before the
error propagates, and reads it again instead of moving past it.

Topics are declared at start-up like every other broker's topology: the service's published
topics and, per consumer, its topic, ``<group>.retry`` and ``<group>.dlq``, each created only if
missing, with ``MESSAGE_BUS__KAFKA_TOPIC_PARTITIONS`` and ``..._KAFKA_REPLICATION_FACTOR``
(``MESSAGE_BUS__KAFKA_CREATE_TOPICS=false`` where a platform team owns topics). An existing topic
is never altered.

Dead letters are read back (:meth:`KafkaTransport.dead_letters`) without a consumer group:
nothing is committed, so a dead letter stays on ``<group>.dlq`` for the topic's retention.

Subscribers start together, not one after another as FastStream starts them: each waits until
its consumer group has assigned it partitions, and a broker holds a group's join for a while
(Kafka's ``group.initial.rebalance.delay.ms``, 3 s by default), so a service with n consumers
(two subscribers each) waited 2n join rounds before it consumed anything.

Tested against a Kafka-protocol broker (the generated suite's ``kafka`` marker) and with
FastStream's TestKafkaBroker and a fake admin client (tests/unit/test_test_brokers.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import NewTopic
from aiokafka.errors import (
    KafkaConnectionError,
    KafkaTimeoutError,
    NodeNotReadyError,
    RequestTimedOutError,
)
from faststream import AckPolicy
from faststream.kafka import KafkaBroker
from faststream.kafka.annotations import KafkaMessage
from faststream.kafka.prometheus import KafkaPrometheusMiddleware

from ...application.handler_types import Consumer
from ...application.messages import IntegrationEvent
from ...application.registry import MessageRegistry
from ...messaging.envelope import Envelope
from ...messaging.settings import MessageBusSettings
from ..naming import EndpointNames
from .base import BROKER_LOG, FastStreamTransport
from .headers import as_text, fallback_parser, undecoded_body
from .kafka_delivery import MAX_REQUEST_SIZE, NOT_BEFORE, KafkaDelivery, readable_headers, retry_wait
from .kafka_topics import TOPIC_EXISTS, KafkaAdmin, KafkaTopologyError, aiokafka_admin
from .ports import DeadLetterCopy, DeliveryHandler

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider


class KafkaTransport(FastStreamTransport):
    label = "Kafka"
    metrics_middleware = KafkaPrometheusMiddleware
    broker: KafkaBroker

    def __init__(
        self,
        settings: MessageBusSettings,
        names: EndpointNames,
        registry: MessageRegistry,
        admin: Callable[[str], KafkaAdmin] = aiokafka_admin,
    ) -> None:
        self._settings = settings
        self._names = names
        self._registry = registry
        self._admin = admin
        self._bootstrap = settings.url or "localhost:9092"
        # max_request_size stated, not defaulted: the consumer's copies are sized against it.
        self.broker = KafkaBroker(
            self._bootstrap, acks="all", max_request_size=MAX_REQUEST_SIZE, logger=BROKER_LOG
        )

    def telemetry_middleware(self, tracer_provider: TracerProvider) -> Any:  # noqa: ANN401
        from faststream.kafka.opentelemetry import KafkaTelemetryMiddleware  # noqa: PLC0415

        return KafkaTelemetryMiddleware(tracer_provider=tracer_provider)

    def topics(self, consumers: Sequence[Consumer[Any]]) -> list[str]:
        """Every topic this service publishes to or reads from (retry and dead-letter included)."""
        published = {self._names.channel(e.message_name) for e in self._registry.classes(IntegrationEvent)}
        consumed = {
            name
            for c in consumers
            for name in (
                self._names.channel(c.event_type.message_name),
                self._names.retry_queue(c.name),
                self._names.dead_letters(c.name),
            )
        }
        return sorted(published | consumed)

    def subscribe(self, consumer: Consumer[Any], handler: DeliveryHandler) -> None:
        topic = self._names.channel(consumer.event_type.message_name)
        group = self._names.queue(consumer.name)
        retry_topic = self._names.retry_queue(consumer.name)
        dlq = self._names.dead_letters(consumer.name)
        broker = self.broker
        delay = self._settings.redelivery_delay_seconds
        longest_backoff = delay * 2 ** (self._settings.max_delivery_attempts - 1)

        # The same group reads both topics; manual acks; the body stays undecoded (see base).
        subscriber = partial(
            broker.subscriber,
            group_id=group,
            ack_policy=AckPolicy.MANUAL,
            auto_offset_reset="earliest",
            decoder=undecoded_body,
            parser=fallback_parser(readable_headers),
        )

        @subscriber(topic)
        async def on_message(message: KafkaMessage) -> None:
            await handler(
                KafkaDelivery(message, broker, topic=topic, retry_topic=retry_topic, dlq=dlq, delay=delay)
            )

        @subscriber(retry_topic)
        async def on_retry(message: KafkaMessage) -> None:
            not_before = dict(message.headers or {}).get(NOT_BEFORE)
            await asyncio.sleep(retry_wait(not_before, time.time(), longest_backoff))
            await handler(
                KafkaDelivery(message, broker, topic=topic, retry_topic=retry_topic, dlq=dlq, delay=delay)
            )

    async def declare(self, consumers: Sequence[Consumer[Any]]) -> None:
        if not self._settings.kafka_create_topics:
            return  # the platform team's topics (or the cluster's auto-create)
        admin = self._admin(self._bootstrap)
        await admin.start()
        try:
            existing = set(await admin.list_topics())
            missing = [topic for topic in self.topics(consumers) if topic not in existing]
            if not missing:
                return
            response = await admin.create_topics(
                [
                    NewTopic(
                        topic,
                        self._settings.kafka_topic_partitions,
                        self._settings.kafka_replication_factor,
                    )
                    for topic in missing
                ]
            )
        finally:
            await admin.close()
        refused = [
            f"{entry[0]} (error {entry[1]}{': ' + str(entry[2]) if len(entry) > 2 and entry[2] else ''})"
            for entry in getattr(response, "topic_errors", [])
            if entry[1] not in (0, TOPIC_EXISTS)
        ]
        if refused:
            msg = (
                f"Kafka refused to create {', '.join(refused)}; create them yourself and set "
                "MESSAGE_BUS__KAFKA_CREATE_TOPICS=false, or fix the partitions/replication settings"
            )
            raise KafkaTopologyError(msg)

    async def delete_topology(self, consumers: Sequence[Consumer[Any]]) -> None:
        del consumers  # topics belong to the cluster's administration

    async def start_consuming(self) -> None:
        """FastStream's ``broker.start()`` with the subscribers started together (see the module)."""
        await self.broker.connect()
        await asyncio.gather(*(subscriber.start() for subscriber in self.broker.subscribers))
        for publisher in self.broker.publishers:
            await publisher.start()
        self.broker.running = True

    async def dead_letters(self, consumer: Consumer[Any], limit: int = 100) -> list[DeadLetterCopy]:
        """The oldest ``limit`` records of the consumer's ``<group>.dlq``, read from the start of
        every partition without a group (nothing committed, nothing removed)."""
        topic = self._names.dead_letters(consumer.name)
        reader = AIOKafkaConsumer(bootstrap_servers=self._bootstrap, enable_auto_commit=False)
        await reader.start()
        try:
            records = await _read_to_end(reader, topic, limit, self._settings.publish_timeout_seconds)
        finally:
            await reader.stop()
        records.sort(key=lambda record: (record.timestamp, record.partition, record.offset))
        return [
            DeadLetterCopy(
                as_text({name: b"" if value is None else value for name, value in record.headers}),
                record.value or b"",
            )
            for record in records[:limit]
        ]

    def is_outage(self, error: BaseException) -> bool:
        return isinstance(
            error, (KafkaConnectionError, KafkaTimeoutError, NodeNotReadyError, RequestTimedOutError)
        )

    async def publish(self, envelope: Envelope, headers: dict[str, str]) -> None:
        await self.broker.publish(
            envelope.body,
            self._names.channel(envelope.event_name),
            key=envelope.ordering_key.encode() if envelope.ordering_key else None,
            headers=headers,
        )


async def _read_to_end(reader: AIOKafkaConsumer, topic: str, limit: int, seconds: float) -> list[Any]:
    """Up to ``limit`` records of each partition of ``topic``, from its start to the end offset
    it had when reading began (records written meanwhile wait for the next read). Returns what
    it has after ``seconds`` at the latest; an unknown topic has no records."""
    if topic not in await reader.topics():
        return []
    partitions = [TopicPartition(topic, p) for p in sorted(reader.partitions_for_topic(topic) or ())]
    reader.assign(partitions)
    await reader.seek_to_beginning(*partitions)
    ends = await reader.end_offsets(partitions)
    counts = dict.fromkeys(partitions, 0)
    records: list[Any] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        unread = [tp for tp in partitions if counts[tp] < limit and await reader.position(tp) < ends[tp]]
        if not unread:
            break
        batches = await reader.getmany(*unread, timeout_ms=200, max_records=limit)
        for tp, batch in batches.items():
            taken = [record for record in batch if record.offset < ends[tp]][: limit - counts[tp]]
            counts[tp] += len(taken)
            records += taken
    return records
