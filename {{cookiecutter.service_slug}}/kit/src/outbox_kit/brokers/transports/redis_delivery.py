"""A Redis stream entry being consumed: not acknowledging is the retry (the reclaimer takes it back
after the idle time); the entry is kept fresh while its handler runs."""

from __future__ import annotations

from faststream.redis import RedisBroker
from faststream.redis.message import RedisStreamMessage as RedisStreamMessageType
from redis.exceptions import ResponseError

from .base import ReceivedMessage
from .copies import NO_LIMIT, publish_copy
from .headers import dead_letter_headers


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
