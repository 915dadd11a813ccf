"""Kafka (any Kafka-protocol broker): one topic per event, one consumer group per consumer, retry
and dead-letter topics.

**Topics** this service publishes to and consumes from are created at start-up where missing
(never altered); a refusal is one clear error.

**A record being consumed** has its attempt count, its retry (a copy on the retry topic, due at
``x-not-before``) and its dead-letter copy.

Both copies are sized against the producer's ``max_request_size`` (the whole serialized record,
headers included) before they are published: a refused copy used to seek the consumer back to
the record, which failed the same way for ever and blocked its partition. A retry copy keeps the
whole body (it is run again) and, when the copy would not fit, only the signed headers; when even
that does not fit, the record is dead-lettered instead of retried (see copies.py).

Kafka: one topic per event, one consumer group per consumer, retry and dead-letter topics.

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
error propagates, and reads it again instead of moving past it. A refused dead-letter copy is
then handed back by the wrapper as a retry copy; once that copy is on the retry topic the record
is committed past all the same, or it would be read again beside its copy (``_pass_over``).

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
FastStream's TestKafkaBroker and a fake admin client (the template's
tests/kit/test_test_brokers.py)."""

from __future__ import annotations

import asyncio
import copy
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import (
    KafkaConnectionError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    NodeNotReadyError,
    RecordListTooLargeError,
    RequestTimedOutError,
    TopicAlreadyExistsError,
)
from faststream import AckPolicy
from faststream.kafka import KafkaBroker
from faststream.kafka.annotations import KafkaMessage
from faststream.kafka.message import KafkaMessage as KafkaMessageType
from faststream.kafka.prometheus import KafkaPrometheusMiddleware
from faststream.message import AckStatus

from outbox_kit.application.handlers import Consumer
from outbox_kit.application.messages import IntegrationEvent, MessageRegistry
from outbox_kit.application.text import as_str
from outbox_kit.transports.base import BROKER_LOG, FastStreamTransport, ReceivedMessage
from outbox_kit.transports.copies import (
    CopyLimit,
    DeadLetterCopy,
    Publish,
    as_text,
    dead_letter_headers,
    publish_copy,
    signed_essentials,
)
from outbox_kit.transports.envelope import Envelope, Signer
from outbox_kit.transports.received import (
    TRUNCATED,
    DeliveryHandler,
    broker_count,
    fallback_parser,
    own_headers,
    the_message,
)
from outbox_kit.transports.settings import EndpointNames, MessageBusSettings

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider


TOPIC_EXISTS = int(TopicAlreadyExistsError.errno)


class KafkaAdmin(Protocol):
    """What the transport uses of aiokafka's admin client (a fake stands in for it in tests)."""

    async def start(self) -> None:
        """Connect to the cluster."""
        ...

    async def close(self) -> None:
        """Disconnect."""
        ...

    async def list_topics(self) -> list[str]:
        """Every topic of the cluster."""
        ...

    async def create_topics(self, new_topics: list[NewTopic]) -> Any:  # noqa: ANN401 (a protocol response)
        """Ask the controller to create topics; per-topic errors come back in ``topic_errors``."""
        ...


class KafkaTopologyError(RuntimeError):
    """The cluster refused to create a topic the service needs."""


def aiokafka_admin(bootstrap_servers: str) -> KafkaAdmin:
    admin: KafkaAdmin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers)
    return admin


ATTEMPT = "x-attempt"

NOT_BEFORE = "x-not-before"

MAX_REQUEST_SIZE = 1_048_576  # the producer's max_request_size (the service sets it: kafka.py)
# Room for what FastStream adds to a publish (content-type, correlation_id) and record framing.
PUBLISH_ROOM = 1024
REFUSALS = (MessageSizeTooLargeError, RecordListTooLargeError)
RETRY_TOO_LARGE = "retry_too_large: the retry copy is over Kafka's record size limit"


def copy_limit(max_request_size: int, key: bytes | None) -> CopyLimit:
    """The producer refuses a record (key, body and headers serialized) over max_request_size."""
    room = max_request_size - PUBLISH_ROOM - len(key or b"")
    return CopyLimit(header_bytes=room, message_bytes=room)


async def readable_headers(record: Any) -> Any:  # noqa: ANN401 (an aiokafka ConsumerRecord)
    """The record with every header value UTF-8 text (bytes escaped, null empty)."""
    readable = copy.copy(record)
    readable.headers = [
        (name, b"" if value is None else as_str(value).encode()) for name, value in record.headers
    ]
    return readable


def retry_wait(not_before: object, now: float, longest: float) -> float:
    """Seconds to wait for a retry copy: until ``x-not-before``, within ``[0, longest]``."""
    try:
        when = float(as_str(not_before or 0))
    except ValueError:
        return 0.0
    return min(max(0.0, when - now), longest) if math.isfinite(when) else 0.0


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
        max_request_size: int = MAX_REQUEST_SIZE,
    ) -> None:
        super().__init__(message)
        self._broker = broker
        self._topic = topic
        self._retry_topic = retry_topic
        self._dlq = dlq
        self._delay = delay
        self._limit = copy_limit(max_request_size, self._key())

    def _key(self) -> bytes | None:
        key = getattr(self._message.raw_message, "key", None)
        return key if isinstance(key, bytes) else None

    async def attempt(self) -> int:
        return max(broker_count(ATTEMPT, self.headers.get(ATTEMPT) or 1), 1)

    def _publisher(self, topic: str) -> Publish:
        async def publish(body: bytes, headers: dict[str, str]) -> None:
            await self._broker.publish(body, topic, key=self._key(), headers=headers)

        return publish

    async def _settle(self, step: Awaitable[None]) -> None:
        """Run the copy's publish, then commit; if it failed, seek back so the record is read again."""
        try:
            await step
        except BaseException:
            await self._message.nack()
            raise
        await self._message.ack()

    async def retry(self, attempt: int) -> None:
        not_before = time.time() + self._delay * 2 ** (attempt - 1)
        carried = {k: v for k, v in own_headers(self.headers).items() if k not in (ATTEMPT, NOT_BEFORE)}
        counters = {ATTEMPT: str(attempt + 1), NOT_BEFORE: str(not_before)}
        headers = carried | counters
        if not self._limit.fits(self.body, headers):  # the signed headers are what a retry needs
            note = "headers: all but the signed ones left out, over Kafka's record size limit"
            headers = signed_essentials(carried) | counters | {TRUNCATED: note}
        if not self._limit.fits(self.body, headers):
            await self.dead_letter(RETRY_TOO_LARGE, attempt)
            return
        try:
            await self._publisher(self._retry_topic)(self.body, headers)
        except REFUSALS:  # the broker's own limit is lower than the producer's
            await self.dead_letter(RETRY_TOO_LARGE, attempt)
            return
        except BaseException:
            await self._message.nack()
            raise
        await self._pass_over()

    async def _pass_over(self) -> None:
        """Commit past the record now that its retry copy is on the retry topic. FastStream's
        ``ack`` does nothing once the message was nacked, which a refused dead-letter copy does
        (the wrapper then hands the message back here): the record, sought back to, was read
        again with its old ``x-attempt`` beside its copy, so the handler ran past the limit and
        the copies multiplied. So a nacked record is sought past, then committed."""
        if self._message.committed is not AckStatus.NACKED:
            await self._message.ack()
            return
        record = self._message.raw_message
        self._message.consumer.seek(TopicPartition(record.topic, record.partition), record.offset + 1)
        await self._message.consumer.commit()  # every consumed position, this one's now past it

    async def dead_letter(self, error: str, attempt: int) -> None:
        copied, essentials = dead_letter_headers(self.headers, error, attempt, self._topic)
        headers = {k: v for k, v in copied.items() if k not in (ATTEMPT, NOT_BEFORE)}
        publish = self._publisher(self._dlq)
        await self._settle(
            publish_copy(
                publish, self.body, headers, essentials=essentials, limit=self._limit, refusals=REFUSALS
            )
        )


class KafkaTransport(FastStreamTransport):
    label = "Kafka"
    cloud_events_prefix = "ce_"  # the CloudEvents Kafka protocol binding
    metrics_middleware = KafkaPrometheusMiddleware
    broker: KafkaBroker

    def __init__(
        self,
        settings: MessageBusSettings,
        names: EndpointNames,
        registry: MessageRegistry,
        signer: Signer,
        admin: Callable[[str], KafkaAdmin] = aiokafka_admin,
    ) -> None:
        super().__init__(settings, names, signer)
        self._registry = registry
        self._admin = admin
        self._bootstrap = settings.url or "localhost:9092"
        # max_request_size stated, not defaulted: the consumer's copies are sized against it.
        self.broker = KafkaBroker(
            self._bootstrap,
            acks="all",
            max_request_size=MAX_REQUEST_SIZE,
            logger=BROKER_LOG,
            apply_types=False,
        )

    def telemetry_middleware(self, tracer_provider: TracerProvider) -> Any:  # noqa: ANN401
        from faststream.kafka.opentelemetry import KafkaTelemetryMiddleware  # noqa: PLC0415

        return KafkaTelemetryMiddleware(tracer_provider=tracer_provider)

    def topics(self, consumers: Sequence[Consumer[Any]]) -> list[str]:
        """Every topic this service publishes to or reads from (retry and dead-letter included)."""
        published = {self.names.channel(e.message_name) for e in self._registry.classes(IntegrationEvent)}
        consumed = {
            name
            for c in consumers
            for name in (
                self.names.channel(c.event_type.message_name),
                self.names.retry_queue(c.name),
                self.names.dead_letters(c.name),
            )
        }
        return sorted(published | consumed)

    def listen(self, consumer: Consumer[Any], handler: DeliveryHandler) -> None:
        topic = self.names.channel(consumer.event_type.message_name)
        group = self.names.queue(consumer.name)
        retry_topic = self.names.retry_queue(consumer.name)
        dlq = self.names.dead_letters(consumer.name)
        broker = self.broker
        delay = self._settings.redelivery_delay_seconds
        longest_backoff = delay * 2 ** (self._settings.max_delivery_attempts - 1)

        # The same group reads both topics; manual acks; the body stays undecoded (see base).
        subscriber = partial(
            broker.subscriber,
            group_id=group,
            ack_policy=AckPolicy.MANUAL,
            auto_offset_reset="earliest",
            session_timeout_ms=round(self._settings.kafka_session_timeout_seconds * 1000),
            heartbeat_interval_ms=round(self._settings.kafka_session_timeout_seconds * 1000 / 3),
            decoder=the_message,
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

    async def drop_topology(self, consumers: Sequence[Consumer[Any]]) -> None:
        del consumers  # topics belong to the cluster's administration

    async def start_consuming(self) -> None:
        """FastStream's ``broker.start()`` with the subscribers started together (see the module)."""
        await self.broker.connect()
        await asyncio.gather(*(subscriber.start() for subscriber in self.broker.subscribers))
        for publisher in self.broker.publishers:
            await publisher.start()
        self.broker.running = True

    async def read_dead_letters(self, consumer: Consumer[Any], limit: int) -> list[DeadLetterCopy]:
        """The oldest ``limit`` records of the consumer's ``<group>.dlq``, read from the start of
        every partition without a group (nothing committed, nothing removed)."""
        topic = self.names.dead_letters(consumer.name)
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

    async def send(self, envelope: Envelope, headers: dict[str, str]) -> None:
        await self.broker.publish(
            envelope.body,
            self.names.channel(envelope.event_name),
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
