"""A Kafka record being consumed: its attempt count, its retry (a copy on the retry topic, due at
x-not-before) and its dead-letter copy."""

from __future__ import annotations

import copy
import math
import time
from typing import Any

from faststream.kafka import KafkaBroker
from faststream.kafka.message import KafkaMessage as KafkaMessageType

from ...kernel.escaping import as_str
from .base import ReceivedMessage
from .headers import broker_count, dead_letter_headers, own_headers

ATTEMPT = "x-attempt"

NOT_BEFORE = "x-not-before"


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
        return max(broker_count(ATTEMPT, self.headers.get(ATTEMPT) or 1), 1)

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
