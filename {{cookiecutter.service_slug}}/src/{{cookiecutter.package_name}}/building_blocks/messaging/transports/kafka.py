"""Kafka: one topic per event, one consumer group per consumer, retry and dead-letter topics.

Kafka has no redelivery count and FastStream's default ack policy commits *before* the handler
runs, so a failed message would be lost. Here the handler runs with a manual ack; a failure is
republished to ``<group>.retry`` with ``x-attempt`` and ``x-not-before`` and only then committed;
the retry subscriber waits until ``x-not-before`` and runs the same wrapper; the last failure goes
to ``<group>.dlq``. The ordering key is the Kafka key, so one key stays on one partition.

Kafka commits offsets, not messages: once a later message of the partition is committed, an
earlier one that was never acknowledged is gone. So when the retry or dead-letter copy cannot be
published (the broker is failing), the consumer seeks back to the message (``nack``) before the
error propagates, and reads it again instead of moving past it.

Tested with FastStream's TestKafkaBroker only (no Kafka server on the build machines).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from aiokafka.errors import KafkaConnectionError, KafkaTimeoutError, NodeNotReadyError, RequestTimedOutError
from faststream import AckPolicy
from faststream.kafka import KafkaBroker
from faststream.kafka.annotations import KafkaMessage
from faststream.kafka.message import KafkaMessage as KafkaMessageType

from ....settings import MessageBusSettings
from ...handlers import Consumer
from ...registry import MessageRegistry
from ..envelope import Envelope
from ..naming import EndpointNames
from .base import (
    DeadLetterCopy,
    DeliveryHandler,
    FastStreamTransport,
    ReceivedMessage,
    dead_letter_headers,
    own_headers,
)

ATTEMPT = "x-attempt"
NOT_BEFORE = "x-not-before"


class KafkaDelivery(ReceivedMessage):
    def __init__(
        self,
        message: KafkaMessageType,
        broker: KafkaBroker,
        *,
        topic: str,
        retry_topic: str,
        dlq: str,
        delay: float,
    ) -> None:
        super().__init__(message)
        self._broker = broker
        self._topic = topic
        self._retry_topic = retry_topic
        self._dlq = dlq
        self._delay = delay

    def _key(self) -> bytes | None:
        key = getattr(self._message.raw_message, "key", None)
        return key if isinstance(key, bytes) else None

    async def attempt(self) -> int:
        return int(str(self.headers.get(ATTEMPT) or 1))

    async def _forward(self, topic: str, headers: dict[str, str]) -> None:
        """Publish the copy, then commit; if the copy is refused, seek back so it is read again."""
        try:
            await self._broker.publish(self.body, topic, key=self._key(), headers=headers)
        except BaseException:
            await self._message.nack()
            raise
        await self._message.ack()

    async def retry(self, attempt: int) -> None:
        not_before = time.time() + self._delay * 2 ** (attempt - 1)
        headers = {k: v for k, v in own_headers(self.headers).items() if k not in (ATTEMPT, NOT_BEFORE)}
        retry_headers = headers | {ATTEMPT: str(attempt + 1), NOT_BEFORE: str(not_before)}
        await self._forward(self._retry_topic, retry_headers)

    async def dead_letter(self, error: str, attempt: int) -> None:
        headers = {
            k: v
            for k, v in dead_letter_headers(self.headers, error, attempt, self._topic).items()
            if k not in (ATTEMPT, NOT_BEFORE)
        }
        await self._forward(self._dlq, headers)


class KafkaTransport(FastStreamTransport):
    label = "Kafka"
    broker: KafkaBroker

    def __init__(self, settings: MessageBusSettings, names: EndpointNames, registry: MessageRegistry) -> None:
        del registry
        self._settings = settings
        self._names = names
        self.broker = KafkaBroker(settings.url or "localhost:9092", acks="all")

    def subscribe(self, consumer: Consumer[Any], handler: DeliveryHandler) -> None:
        topic = self._names.channel(consumer.event_type.message_name)
        group = self._names.queue(consumer.name)
        retry_topic = self._names.retry_queue(consumer.name)
        dlq = self._names.dead_letters(consumer.name)
        broker = self.broker
        delay = self._settings.redelivery_delay_seconds

        @broker.subscriber(topic, group_id=group, ack_policy=AckPolicy.MANUAL, auto_offset_reset="earliest")
        async def on_message(message: KafkaMessage) -> None:
            await handler(
                KafkaDelivery(message, broker, topic=topic, retry_topic=retry_topic, dlq=dlq, delay=delay)
            )

        @broker.subscriber(
            retry_topic, group_id=group, ack_policy=AckPolicy.MANUAL, auto_offset_reset="earliest"
        )
        async def on_retry(message: KafkaMessage) -> None:
            not_before = float(str(dict(message.headers or {}).get(NOT_BEFORE) or 0))
            await asyncio.sleep(max(0.0, not_before - time.time()))
            await handler(
                KafkaDelivery(message, broker, topic=topic, retry_topic=retry_topic, dlq=dlq, delay=delay)
            )

    async def declare(self, consumers: Sequence[Consumer[Any]]) -> None:
        del consumers  # topics are created by the cluster (auto-create) or by your platform team

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
