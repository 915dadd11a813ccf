"""Redis Streams: one stream per event, one consumer group per consumer, a reclaimer.

**Entries** are read as FastStream writes them, with header lengths counted right
(FastStream 0.7.8 writes lengths in characters and bytes in UTF-8), and an entry FastStream
cannot read kept whole.

**Not acknowledging is the retry**, and the entry is kept fresh while its handler runs: the
entry stays in the group's pending list and a second subscriber with ``min_idle_time``
(``XAUTOCLAIM``) takes it back once it has been idle for
``MESSAGE_BUS__REDELIVERY_DELAY_SECONDS``; that reclaimer is also what rescues the entries of a
consumer that crashed. The group is created at ``0`` before anything publishes (FastStream would
create it at ``$`` and skip earlier entries). Streams are never trimmed: trimming deletes
pending entries.

Reclaiming goes by idle time alone, so a stalled event loop (a CPU-starved container, a long GC
pause) can let this process's own reclaimer take an entry its handler is still running. The
transport keeps the entry ids in flight and drops such a copy unacknowledged: the running handler
acks it or leaves it pending, exactly as if the copy had never come. The reclaim counted a
delivery all the same (XPENDING's count is the attempt), so the drop takes it back
(:data:`UNCOUNT`): a stalled handler still runs exactly ``MESSAGE_BUS__MAX_DELIVERY_ATTEMPTS``
times before its dead letter, not one fewer per dropped copy. Another process can still
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
size; ASCII headers encode exactly as before, so old and new processes read each other."""

from __future__ import annotations

import inspect
import json
import logging
import os
import re
import socket
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from faststream import AckPolicy
from faststream.redis import RedisBroker, StreamSub
from faststream.redis.annotations import RedisStreamMessage
from faststream.redis.message import RedisStreamMessage as RedisStreamMessageType
from faststream.redis.message import bDATA_KEY
from faststream.redis.parser.binary import BinaryMessageFormatV1
from faststream.redis.prometheus import RedisPrometheusMiddleware
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from outbox_kit.application.handlers import Consumer
from outbox_kit.application.messages import MessageRegistry
from outbox_kit.application.text import as_str
from outbox_kit.transports.base import BROKER_LOG, FastStreamTransport, KnownConsumers, ReceivedMessage
from outbox_kit.transports.bus import Unrouted
from outbox_kit.transports.copies import NO_LIMIT, DeadLetterCopy, as_text, dead_letter_headers, publish_copy
from outbox_kit.transports.envelope import Envelope, Signer, claimed_context
from outbox_kit.transports.received import DeliveryHandler, fallback_parser, the_message
from outbox_kit.transports.settings import EndpointNames, MessageBusSettings

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider


def raw_entry(fields: Mapping[Any, Any]) -> bytes:
    """The bytes an unreadable stream entry carried: its ``__data__``, or all its fields."""
    data = fields.get(bDATA_KEY)
    if isinstance(data, bytes):
        return data
    return json.dumps({as_str(name): as_str(value) for name, value in fields.items()}).encode()


def utf8_headers(headers: Mapping[str, Any]) -> dict[Any, Any]:
    """Header names and text values as UTF-8 bytes (FastStream measures bytes correctly)."""
    return {
        name.encode(): value.encode() if isinstance(value, str) else value for name, value in headers.items()
    }


class Utf8BinaryMessageFormat(BinaryMessageFormatV1):
    """FastStream's binary format with header names and values written as UTF-8 bytes."""

    @classmethod
    async def encode(cls, *, headers: dict[str, Any] | None, **parts: Any) -> bytes:  # noqa: ANN401
        return await super().encode(headers=None if headers is None else utf8_headers(headers), **parts)


def as_entry_id(entry_id: bytes | str) -> str:
    return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)


class RedisDelivery(ReceivedMessage):
    def __init__(
        self,
        message: RedisStreamMessageType,
        broker: RedisBroker,
        *,
        stream: str,
        dlq: str,
        group: str,
        member: str,
        idle_seconds: float,
    ) -> None:
        super().__init__(message)
        self._broker = broker
        self._stream = stream
        self._dlq = dlq
        self._group = group
        self._member = member
        self._idle_seconds = idle_seconds

    @property
    def heartbeat_seconds(self) -> float | None:
        return max(self._idle_seconds / 3, 0.05)  # the reclaimer takes entries idle that long

    async def touch(self) -> None:
        """``XCLAIM ... JUSTID`` to ourselves resets the idle time, not the delivery count."""
        entry_ids = self._message.raw_message.get("message_ids") or []
        if entry_ids:
            await self._broker.config.connection.client.xclaim(
                self._stream, self._group, self._member, 0, list(entry_ids), justid=True
            )

    async def attempt(self) -> int:
        return int(await self._message.get_delivery_count())

    async def retry(self, attempt: int) -> None:
        del attempt  # left pending: the reclaimer delivers it again after min_idle_time

    async def dead_letter(self, error: str, attempt: int) -> None:
        async def publish(body: bytes, headers: dict[str, str]) -> None:
            await self._broker.publish(body, stream=self._dlq, headers=headers)

        headers, essentials = dead_letter_headers(self.headers, error, attempt, self._stream)
        # A stream entry may hold up to 512 MB (proto-max-bulk-len), and the copy's body is the
        # original's: only the headers are bounded (by dead_letter_headers). An error reply about
        # this entry (a server over maxmemory refusing a large write) gets the minimal copy.
        await publish_copy(
            publish, self.body, headers, essentials=essentials, limit=NO_LIMIT, refusals=(ResponseError,)
        )
        await self._message.ack()


log = logging.getLogger(__name__)
FRESH_READ_COUNT = 10  # entries per XREADGROUP, as NATS pulls (see ``subscribe``)

# Takes back the delivery this member's reclaim counted for an entry whose copy it dropped:
# ``XCLAIM ... JUSTID RETRYCOUNT count-1`` (JUSTID alone never counts), in one script so that an
# entry another member claimed meanwhile (no longer ours) or acknowledged (no longer pending) is
# left alone. KEYS[1] the stream; ARGV the group, the member, the entry id.
UNCOUNT = """
local pending = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)[1]
if pending and pending[2] == ARGV[2] and tonumber(pending[4]) > 1 then
  local count = tonumber(pending[4]) - 1
  redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[3], 'JUSTID', 'RETRYCOUNT', count)
  return 1
end
return 0
"""


class RedisTransport(FastStreamTransport):
    label = "Redis"
    metrics_middleware = RedisPrometheusMiddleware
    broker: RedisBroker

    def __init__(
        self, settings: MessageBusSettings, names: EndpointNames, registry: MessageRegistry, signer: Signer
    ) -> None:
        super().__init__(settings, names, signer)
        del registry
        self.broker = RedisBroker(
            settings.url or "redis://localhost:6379",
            message_format=Utf8BinaryMessageFormat,
            logger=BROKER_LOG,
            apply_types=False,
        )
        self._member = re.sub(r"[^A-Za-z0-9_.:-]", "-", f"{socket.gethostname()}-{os.getpid()}")
        self._in_flight: set[tuple[str, str, str]] = set()
        self._known = KnownConsumers()

    def _stream(self, consumer: Consumer[Any]) -> str:
        return self.names.channel(consumer.event_type.message_name)

    def listen(self, consumer: Consumer[Any], handler: DeliveryHandler) -> None:
        stream = self._stream(consumer)
        group = self.names.queue(consumer.name)
        dlq = self.names.dead_letters(consumer.name)
        idle_ms = int(self._settings.redelivery_delay_seconds * 1000)
        broker = self.broker

        async def on_message(message: RedisStreamMessage) -> None:
            entries = {(stream, group, as_entry_id(e)) for e in message.raw_message.get("message_ids") or []}
            if entries & self._in_flight:
                await self._uncount(stream, group, entries & self._in_flight)
                with claimed_context(message.headers or {}):  # a line about the message: its context
                    log.info(
                        "%s: entry %s is still being handled here; copy dropped", stream, message.message_id
                    )
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
                decoder=the_message,
            )(on_message)

    async def _uncount(self, stream: str, group: str, entries: set[tuple[str, str, str]]) -> None:
        """A dropped copy costs no attempt (see the module and :data:`UNCOUNT`)."""
        client = self.broker.config.connection.client
        for _, _, entry_id in sorted(entries):
            await client.eval(UNCOUNT, 1, stream, group, self._member, entry_id)

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
                    self._stream(consumer), self.names.queue(consumer.name), id="0", mkstream=True
                )
            except ResponseError as error:
                if "BUSYGROUP" not in str(error):
                    raise

    async def drop_topology(self, consumers: Sequence[Consumer[Any]]) -> None:
        names = {self._stream(c) for c in consumers} | {self.names.dead_letters(c.name) for c in consumers}
        if names:
            await self.broker.config.connection.client.delete(*sorted(names))

    async def read_dead_letters(self, consumer: Consumer[Any], limit: int) -> list[DeadLetterCopy]:
        entries = await self.broker.config.connection.client.xrange(
            self.names.dead_letters(consumer.name), count=limit
        )
        copies = []
        for _entry_id, fields in entries:
            body, headers = self.broker.message_format.parse(fields[bDATA_KEY])
            copies.append(DeadLetterCopy(as_text(headers), body))
        return copies

    def is_outage(self, error: BaseException) -> bool:
        return isinstance(error, (RedisConnectionError, RedisTimeoutError))

    async def send(self, envelope: Envelope, headers: dict[str, str]) -> Unrouted | None:
        """XADD; :class:`Unrouted` when no consumer group reads the stream yet (the entry stays in
        the stream: a group created later, at id 0, reads it)."""
        stream = self.names.channel(envelope.event_name)
        await self.broker.publish(envelope.body, stream=stream, headers=headers)
        client = self.broker.config.connection.client

        async def has_group() -> bool:
            groups = client.xinfo_groups(stream)
            # FastStream's TestRedisBroker swaps the client for a mock that routes in memory:
            # there is no stream to ask about, and the test broker delivers to its subscribers.
            return not inspect.isawaitable(groups) or bool(await groups)

        detail = f"no consumer group reads stream {stream} yet; the entry stays there for the first group"
        return await self._known.unrouted(stream, has_group, detail)

    def telemetry_middleware(self, tracer_provider: TracerProvider) -> Any:  # noqa: ANN401
        from faststream.redis.opentelemetry import RedisTelemetryMiddleware  # noqa: PLC0415

        return RedisTelemetryMiddleware(tracer_provider=tracer_provider)
