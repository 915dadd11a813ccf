"""A Kafka record being consumed: its attempt count, its retry (a copy on the retry topic, due at
x-not-before) and its dead-letter copy.

Both copies are sized against the producer's ``max_request_size`` (the whole serialized record,
headers included) before they are published: a refused copy used to seek the consumer back to
the record, which failed the same way for ever and blocked its partition. A retry copy keeps the
whole body (it is run again) and, when the copy would not fit, only the signed headers; when even
that does not fit, the record is dead-lettered instead of retried (see copies.py)."""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Awaitable
from typing import Any

from aiokafka.errors import MessageSizeTooLargeError, RecordListTooLargeError
from faststream.kafka import KafkaBroker
from faststream.kafka.message import KafkaMessage as KafkaMessageType

from ...kernel.escaping import as_str
from .base import ReceivedMessage
from .copies import TRUNCATED, CopyLimit, Publish, publish_copy, signed_essentials
from .headers import broker_count, dead_letter_headers, own_headers

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
        await self._message.ack()

    async def dead_letter(self, error: str, attempt: int) -> None:
        copied, essentials = dead_letter_headers(self.headers, error, attempt, self._topic)
        headers = {k: v for k, v in copied.items() if k not in (ATTEMPT, NOT_BEFORE)}
        publish = self._publisher(self._dlq)
        await self._settle(
            publish_copy(
                publish, self.body, headers, essentials=essentials, limit=self._limit, refusals=REFUSALS
            )
        )
