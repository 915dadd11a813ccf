"""A RabbitMQ message being consumed: the attempt read from x-death and x-delivery-count, the retry
through the TTL queue, and the dead-letter copy."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aiormq.exceptions import ChannelInvalidStateError
from faststream.rabbit import RabbitBroker
from faststream.rabbit.message import RabbitMessage as RabbitMessageType
from pamqp.encode import field_table

from ...messaging.rejections import RejectedMessageError, Rejection
from .base import ReceivedMessage
from .copies import CopyLimit, publish_copy
from .headers import broker_count, dead_letter_headers

DEFAULT_FRAME_MAX = 131_072  # RabbitMQ's, when the connection's negotiated value is not at hand
# Room in the content-header frame for what is not the header table: the frame's own fields and
# the other properties (content type, message id, delivery mode, ...).
PROPERTIES_ROOM = 1024


def table_size(headers: Mapping[str, str]) -> int:
    """The header table as AMQP encodes it into the content-header frame."""
    return len(field_table(dict[str, Any](headers)))


def copy_limit(frame_max: int) -> CopyLimit:
    """The header table of a copy must fit one content-header frame (``frame_max``): a larger one
    is a connection error, RabbitMQ closes the whole connection. Bodies travel in as many frames
    as they need, and the copy's body is the original's, which the broker accepted."""
    return CopyLimit(header_bytes=frame_max - PROPERTIES_ROOM, message_bytes=None, header_size=table_size)


class RabbitDelivery(ReceivedMessage):
    def __init__(
        self, message: RabbitMessageType, broker: RabbitBroker, main: str, dlq: str, *, publish_timeout: float
    ) -> None:
        super().__init__(message, message.raw_message.headers or {})  # x-death stays a list
        self._broker = broker
        self._main = main
        self._dlq = dlq
        self._publish_timeout = publish_timeout

    async def attempt(self) -> int:
        """Rejections counted in ``x-death`` plus crash redeliveries (``x-delivery-count``), plus
        one. Both are the broker's; a shape it never writes rejects the message (see base)."""
        deaths = self.headers.get("x-death") or []
        if not isinstance(deaths, list) or not all(isinstance(death, dict) for death in deaths):
            raise RejectedMessageError(Rejection.MALFORMED_HEADER, "x-death is not a list of tables")
        rejected = sum(
            broker_count("x-death count", death.get("count", 0))
            for death in deaths
            if death.get("queue") == self._main and death.get("reason") == "rejected"
        )
        crashed = broker_count("x-delivery-count", self.headers.get("x-delivery-count") or 0)
        return rejected + crashed + 1

    async def retry(self, attempt: int) -> None:
        del attempt  # the retry queue's TTL is the delay
        await self._message.reject()  # requeue=False: main -> DLX -> retry queue -> TTL -> main

    def _frame_max(self) -> int:
        """The frame size negotiated on the connection this message came in on (FastStream
        consumes and publishes on one connection)."""
        try:
            return int(self._message.raw_message.channel.connection.connection_tune.frame_max)
        except (AttributeError, ChannelInvalidStateError):  # TestRabbitBroker, or a closed channel
            return DEFAULT_FRAME_MAX

    async def dead_letter(self, error: str, attempt: int) -> None:
        async def publish(body: bytes, headers: dict[str, str]) -> None:
            await self._broker.publish(
                body,
                queue=self._dlq,
                headers=dict[str, Any](headers),
                persist=True,
                content_type=self._message.content_type or "application/json",
                message_id=self._message.message_id,  # the AMQP property as it came (a short string)
                timeout=self._publish_timeout,  # the confirm wait, bounded as every other publish
            )

        headers, essentials = dead_letter_headers(self.headers, error, attempt, self._main)
        # No refusal to fall back from: the size is checked before, and what RabbitMQ refuses
        # otherwise (NO_ROUTE: the queue is gone) no smaller copy would cure.
        limit = copy_limit(self._frame_max())
        await publish_copy(publish, self.body, headers, essentials=essentials, limit=limit, refusals=())
        await self._message.ack()
