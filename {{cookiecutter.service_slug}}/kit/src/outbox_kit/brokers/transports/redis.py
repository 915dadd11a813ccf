"""Redis Streams: one stream per event, one consumer group per consumer, a reclaimer.

Not acknowledging is the retry: the entry stays in the group's pending list and a second
subscriber with ``min_idle_time`` (``XAUTOCLAIM``) takes it back once it has been idle for
``MESSAGE_BUS__REDELIVERY_DELAY_SECONDS``; that reclaimer is also what rescues the entries of a
consumer that crashed. The group is created at ``0`` before anything publishes (FastStream would
create it at ``$`` and skip earlier entries). Streams are never trimmed: trimming deletes pending
entries.

Reclaiming goes by idle time alone, so a stalled event loop (a CPU-starved container, a long GC
pause) can let this process's own reclaimer take an entry its handler is still running. The
transport keeps the entry ids in flight and drops such a copy unacknowledged: the running handler
acks it or leaves it pending, exactly as if the copy had never come. Another process can still
take an entry whose heartbeat stalled past the idle time; the inbox makes that second run a
duplicate that changes nothing.

FastStream's stream parser fails on some entries anyone can ``XADD`` (a legacy JSON envelope
whose ``headers`` is not an object, fields without ``__data__`` that are not UTF-8). The handler
would never run and the entry would be reclaimed and fail again for ever; such an entry is read
again as a message without headers whose body is the entry's raw bytes, and is dead-lettered
like any other unreadable message (FastStream itself does the same for a header that is not
UTF-8).

FastStream 0.7.8's binary message format writes each header's length in characters but its
bytes in UTF-8, so one non-ASCII value (a tenant ``zoë-gmbh``) shifted the whole header block:
the consumer read the message without headers and rejected it as unsigned.
:class:`Utf8BinaryMessageFormat` hands the headers over as UTF-8 bytes, whose length is their
size; ASCII headers encode exactly as before, so old and new processes read each other.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from faststream import AckPolicy
from faststream.redis import RedisBroker, StreamSub
from faststream.redis.annotations import RedisStreamMessage
from faststream.redis.message import bDATA_KEY
from faststream.redis.prometheus import RedisPrometheusMiddleware
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ...application.handler_types import Consumer
from ...application.registry import MessageRegistry
from ...messaging.envelope import Envelope
from ...messaging.settings import MessageBusSettings
from ..naming import EndpointNames
from .base import BROKER_LOG, FastStreamTransport
from .headers import as_text, fallback_parser, undecoded_body
from .ports import DeadLetterCopy, DeliveryHandler
from .redis_delivery import RedisDelivery, as_entry_id
from .redis_format import Utf8BinaryMessageFormat, raw_entry

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

log = logging.getLogger(__name__)
FRESH_READ_COUNT = 10  # entries per XREADGROUP, as NATS pulls (see ``subscribe``)


class RedisTransport(FastStreamTransport):
    label = "Redis"
    metrics_middleware = RedisPrometheusMiddleware
    broker: RedisBroker

    def __init__(self, settings: MessageBusSettings, names: EndpointNames, registry: MessageRegistry) -> None:
        del registry
        self._settings = settings
        self._names = names
        self.broker = RedisBroker(
            settings.url or "redis://localhost:6379",
            message_format=Utf8BinaryMessageFormat,
            logger=BROKER_LOG,
        )
        self._member = re.sub(r"[^A-Za-z0-9_.:-]", "-", f"{socket.gethostname()}-{os.getpid()}")
        self._in_flight: set[tuple[str, str, str]] = set()

    def _stream(self, consumer: Consumer[Any]) -> str:
        return self._names.channel(consumer.event_type.message_name)

    def subscribe(self, consumer: Consumer[Any], handler: DeliveryHandler) -> None:
        stream = self._stream(consumer)
        group = self._names.queue(consumer.name)
        dlq = self._names.dead_letters(consumer.name)
        idle_ms = int(self._settings.redelivery_delay_seconds * 1000)
        broker = self.broker

        async def on_message(message: RedisStreamMessage) -> None:
            entries = {(stream, group, as_entry_id(e)) for e in message.raw_message.get("message_ids") or []}
            if entries & self._in_flight:
                log.info("%s: entry %s is still being handled here; copy dropped", stream, message.message_id)
                return
            self._in_flight |= entries
            try:
                await handler(
                    RedisDelivery(
                        message,
                        broker,
                        stream=stream,
                        dlq=dlq,
                        group=group,
                        member=self._member,
                        idle_seconds=idle_ms / 1000,
                    )
                )
            finally:
                self._in_flight -= entries

        # A few entries per read: entries read but not yet handled are not kept fresh, so with
        # FastStream's unbounded read a backlog sat idle here until reclaimers (any process)
        # took them, each reclaim a charged attempt: duplicates, and good messages dead-lettered.
        fresh = StreamSub(stream, group=group, consumer=self._member, max_records=FRESH_READ_COUNT)
        reclaimer = StreamSub(stream, group=group, consumer=self._member, min_idle_time=idle_ms)
        for source in (fresh, reclaimer):
            broker.subscriber(
                stream=source,
                ack_policy=AckPolicy.MANUAL,
                parser=fallback_parser(self._readable),
                decoder=undecoded_body,
            )(on_message)

    async def _readable(self, entry: Mapping[str, Any]) -> Mapping[str, Any]:
        """The entry as a message without headers whose body is its raw bytes (see the module)."""
        wrapped = await self.broker.message_format.encode(
            message=raw_entry(entry["data"]), reply_to=None, headers={}, correlation_id=""
        )
        return {**entry, "data": {bDATA_KEY: wrapped}}

    async def declare(self, consumers: Sequence[Consumer[Any]]) -> None:
        client = self.broker.config.connection.client
        for consumer in consumers:
            try:
                await client.xgroup_create(
                    self._stream(consumer), self._names.queue(consumer.name), id="0", mkstream=True
                )
            except ResponseError as error:
                if "BUSYGROUP" not in str(error):
                    raise

    async def delete_topology(self, consumers: Sequence[Consumer[Any]]) -> None:
        names = {self._stream(c) for c in consumers} | {self._names.dead_letters(c.name) for c in consumers}
        if names:
            await self.broker.config.connection.client.delete(*sorted(names))

    async def dead_letters(self, consumer: Consumer[Any], limit: int = 100) -> list[DeadLetterCopy]:
        entries = await self.broker.config.connection.client.xrange(
            self._names.dead_letters(consumer.name), count=limit
        )
        copies = []
        for _entry_id, fields in entries:
            body, headers = self.broker.message_format.parse(fields[bDATA_KEY])
            copies.append(DeadLetterCopy(as_text(headers), body))
        return copies

    def is_outage(self, error: BaseException) -> bool:
        return isinstance(error, (RedisConnectionError, RedisTimeoutError))

    async def publish(self, envelope: Envelope, headers: dict[str, str]) -> None:
        await self.broker.publish(
            envelope.body, stream=self._names.channel(envelope.event_name), headers=headers
        )

    def telemetry_middleware(self, tracer_provider: TracerProvider) -> Any:  # noqa: ANN401
        from faststream.redis.opentelemetry import RedisTelemetryMiddleware  # noqa: PLC0415

        return RedisTelemetryMiddleware(tracer_provider=tracer_provider)
