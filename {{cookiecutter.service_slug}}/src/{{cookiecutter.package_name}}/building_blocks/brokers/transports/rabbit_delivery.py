"""A RabbitMQ message being consumed: the attempt read from x-death and x-delivery-count, the retry
through the TTL queue, and the dead-letter copy."""

from __future__ import annotations

from typing import Any

from faststream.rabbit import RabbitBroker
from faststream.rabbit.message import RabbitMessage as RabbitMessageType

from ...messaging.rejections import RejectedMessageError, Rejection
from .base import ReceivedMessage
from .headers import broker_count, dead_letter_headers


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

    async def dead_letter(self, error: str, attempt: int) -> None:
        await self._broker.publish(
            self.body,
            queue=self._dlq,
            headers=dict[str, Any](dead_letter_headers(self.headers, error, attempt, self._main)),
            persist=True,
            content_type=self._message.content_type or "application/json",
            message_id=self._message.message_id,  # the AMQP property as it came (a short string)
            timeout=self._publish_timeout,  # the confirm wait, bounded as every other publish
        )
        await self._message.ack()
