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

Tested with FastStream's TestKafkaBroker and a fake admin client only (no Kafka server on the
build machines): the topic declaration and the retry topics have not met a real cluster here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

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

from ....settings import MessageBusSettings
from ...application.handler_types import Consumer
from ...application.messages import IntegrationEvent
from ...application.registry import MessageRegistry
from ...messaging.envelope import Envelope
from ..naming import EndpointNames
from .base import FastStreamTransport
from .headers import fallback_parser, undecoded_body
from .kafka_delivery import NOT_BEFORE, KafkaDelivery, readable_headers, retry_wait
from .kafka_topics import TOPIC_EXISTS, KafkaAdmin, KafkaTopologyError, aiokafka_admin
from .ports import DeadLetterCopy, DeliveryHandler


class KafkaTransport(FastStreamTransport):
    label = "Kafka"
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
        self.broker = KafkaBroker(self._bootstrap, acks="all")

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

    async def dead_letters(self, consumer: Consumer[Any], limit: int = 100) -> list[DeadLetterCopy]:
        del consumer, limit
        msg = "read Kafka dead letters with a consumer on the <group>.dlq topic (kafka-console-consumer)"
        raise NotImplementedError(msg)

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
