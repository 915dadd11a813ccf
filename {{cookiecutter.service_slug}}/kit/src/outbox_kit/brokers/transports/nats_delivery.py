"""A JetStream message being consumed: its delivery count, a delayed nack as the retry, in_progress
as the heartbeat, and a dead-letter copy on the DLQ stream."""

from __future__ import annotations

from collections.abc import Mapping

from faststream.nats import NatsBroker
from faststream.nats.message import NatsMessage as NatsMessageType
from nats.errors import MaxPayloadError, NotJSMessageError
from nats.js.errors import BadRequestError

from .base import ReceivedMessage
from .copies import CopyLimit, publish_copy
from .headers import dead_letter_headers

ACK_WAIT_SECONDS = 30
DEFAULT_MAX_PAYLOAD = 1_048_576  # the server's default, when the connection's is not at hand
JETSTREAM_HEADER_BYTES = 65_536  # "header size exceeds maximum allowed of 64k" (err_code 10097)
# Room for what FastStream and the client add to a publish (content-type, correlation_id).
PUBLISH_ROOM = 1024
# What JetStream answers about one message (headers too large, ...): the minimal copy may pass.
REFUSALS = (BadRequestError, MaxPayloadError)


def header_block_size(headers: Mapping[str, str]) -> int:
    """The header block as NATS writes it: ``NATS/1.0``, one ``name: value`` line each, CRLFs."""
    return 12 + sum(len(name.encode()) + len(value.encode()) + 4 for name, value in headers.items())


def copy_limit(max_payload: int) -> CopyLimit:
    """JetStream refuses headers over 64 KiB (a message-level error), and the server closes the
    whole connection on a message (headers and body) over ``max_payload``: the client checks
    only the body, so the copy is measured here before it is published."""
    return CopyLimit(
        header_bytes=JETSTREAM_HEADER_BYTES - PUBLISH_ROOM,
        message_bytes=max_payload - PUBLISH_ROOM,
        header_size=header_block_size,
    )


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

    def _max_payload(self) -> int:
        client = getattr(self._message.raw_message, "_client", None)
        return int(getattr(client, "max_payload", DEFAULT_MAX_PAYLOAD))

    async def dead_letter(self, error: str, attempt: int) -> None:
        async def publish(body: bytes, headers: dict[str, str]) -> None:
            # FastStream waits 0.5 s for the ack unless told: a busy server's late ack failed the copy.
            await self._broker.publish(
                body, self._dlq_subject, headers=headers, stream=self._dlq_stream, timeout=self._timeout
            )

        copied, essentials = dead_letter_headers(
            self.headers, error, attempt, self._message.raw_message.subject
        )
        headers = {k: v for k, v in copied.items() if not k.startswith("Nats-")}
        limit = copy_limit(self._max_payload())
        await publish_copy(publish, self.body, headers, essentials=essentials, limit=limit, refusals=REFUSALS)
        await self._message.ack()
