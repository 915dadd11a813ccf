"""A JetStream message being consumed: its delivery count, a delayed nack as the retry, in_progress
as the heartbeat, and a dead-letter copy on the DLQ stream."""

from __future__ import annotations

from faststream.nats import NatsBroker
from faststream.nats.message import NatsMessage as NatsMessageType
from nats.errors import NotJSMessageError

from .base import ReceivedMessage
from .headers import dead_letter_headers

ACK_WAIT_SECONDS = 30


class NatsDelivery(ReceivedMessage):
    def __init__(
        self,
        message: NatsMessageType,
        broker: NatsBroker,
        *,
        dlq_subject: str,
        dlq_stream: str,
        delay: float,
        publish_timeout: float,
    ) -> None:
        super().__init__(message)
        self._broker = broker
        self._dlq_subject = dlq_subject
        self._dlq_stream = dlq_stream
        self._delay = delay
        self._timeout = publish_timeout

    async def attempt(self) -> int:
        try:
            return int(self._message.raw_message.metadata.num_delivered)
        except NotJSMessageError:  # a core-NATS message (FastStream's TestNatsBroker): no count
            return 1

    async def retry(self, attempt: int) -> None:
        await self._message.nack(delay=self._delay * 2 ** (attempt - 1))

    @property
    def heartbeat_seconds(self) -> float | None:
        return ACK_WAIT_SECONDS / 3  # a handler slower than ack_wait would run twice at once

    async def touch(self) -> None:
        await self._message.in_progress()

    async def dead_letter(self, error: str, attempt: int) -> None:
        copied = dead_letter_headers(self.headers, error, attempt, self._message.raw_message.subject)
        headers = {k: v for k, v in copied.items() if not k.startswith("Nats-")}
        # FastStream waits 0.5 s for the ack unless told: a busy server's late ack failed the copy.
        await self._broker.publish(
            self.body, self._dlq_subject, headers=headers, stream=self._dlq_stream, timeout=self._timeout
        )
        await self._message.ack()
