"""NATS JetStream: one events stream, one durable pull consumer per consumer, a DLQ stream.

**Consuming.** A JetStream message being consumed has its delivery count, a delayed nack as the
retry, ``in_progress`` as the heartbeat, and a dead-letter copy on the DLQ stream. A failure is
retried with ``nack(delay=...)`` (exponential from ``MESSAGE_BUS__REDELIVERY_DELAY_SECONDS``,
never longer than the last retry's delay). The wrapper counts attempts from ``num_delivered``;
the durable consumer has no ``max_deliver``, because JetStream stops redelivering a message past
it, unacknowledged and never dead-lettered: a message whose dead-letter copy is refused (the DLQ
stream gone) is handed back once per delivery, for as long as the refusal lasts. Past the limit
a redelivery runs no handler: the crash guard only tries the copy again, until the stream takes
it. Publishes go through JetStream (``stream=``), never core NATS (a core publish to a subject
no stream captures is silently lost), and carry ``Nats-Msg-Id`` so JetStream drops a duplicate
publish within its dedup window.

**Topology**: the streams and durable consumers the transport relies on. Declaring a stream only
ever adds subjects. Services that share a namespace share its events stream, and during a rolling
deploy the old and the new version both declare it: replacing the subject list with our own
would make the other side's publishes fail until it declares again. The update keeps the
stream's other settings (limits an operator set stay) and is re-checked, because two services
can merge at the same moment. An existing durable consumer is brought to the consumer's
``max_deliver`` (none) and ``ack_wait``.

**Readiness** (``ping``) asks the server itself: a JetStream account-info request, answered by the
JetStream the transport relies on. FastStream's ``ping`` reads the client's ``is_connected``
flag, which stays set on a line gone silent. Not ``flush()`` (PING/PONG) either: a flush that
times out cancels its future, and the late PONG, once the line flows again, then kills the
client's read loop (``InvalidStateError``), so the connection would never deliver again; a
request that times out only forgets its reply."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from faststream import AckPolicy
from faststream.nats import ConsumerConfig, JStream, NatsBroker, PullSub
from faststream.nats.annotations import NatsMessage
from faststream.nats.message import NatsMessage as NatsMessageType
from faststream.nats.prometheus import NatsPrometheusMiddleware
from nats.errors import ConnectionClosedError, MaxPayloadError, NoServersError, NotJSMessageError
from nats.js.errors import BadRequestError, NotFoundError, ServiceUnavailableError

from outbox_kit.application.handlers import Consumer
from outbox_kit.application.messages import IntegrationEvent, MessageRegistry
from outbox_kit.transports.base import (
    BROKER_LOG,
    FastStreamTransport,
    KnownConsumers,
    PingFailedError,
    ReceivedMessage,
)
from outbox_kit.transports.bus import Unrouted
from outbox_kit.transports.copies import CopyLimit, DeadLetterCopy, as_text, dead_letter_headers, publish_copy
from outbox_kit.transports.envelope import Envelope, Signer
from outbox_kit.transports.received import DeliveryHandler, the_message
from outbox_kit.transports.settings import EndpointNames, MessageBusSettings

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider


ACK_WAIT_SECONDS = 30
UNLIMITED_DELIVERIES = -1  # JetStream's max_deliver for "no limit" (see the module)
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


def retry_delay(delay: float, attempt: int, longest: float) -> float:
    """``delay * 2^(attempt-1)``, at most ``longest``."""
    return min(delay * 2.0 ** min(max(attempt - 1, 0), 32), longest)


class NatsDelivery(ReceivedMessage):
    def __init__(
        self,
        message: NatsMessageType,
        broker: NatsBroker,
        *,
        dlq_subject: str,
        dlq_stream: str,
        delay: float,
        longest_delay: float,
        publish_timeout: float,
    ) -> None:
        super().__init__(message)
        self._broker = broker
        self._dlq_subject = dlq_subject
        self._dlq_stream = dlq_stream
        self._delay = delay
        self._longest_delay = longest_delay
        self._timeout = publish_timeout

    async def attempt(self) -> int:
        try:
            return int(self._message.raw_message.metadata.num_delivered)
        except NotJSMessageError:  # a core-NATS message (FastStream's TestNatsBroker): no count
            return 1

    async def retry(self, attempt: int) -> None:
        """Nack with the attempt's backoff; a message handed back past the limit (its
        dead-letter copy refused) waits the longest one each time, not an ever doubling one."""
        await self._message.nack(delay=retry_delay(self._delay, attempt, self._longest_delay))

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


DECLARE_ATTEMPTS = 5


def durable_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", name)


async def ensure_stream(js: Any, name: str, subjects: list[str]) -> None:  # noqa: ANN401 (nats' JetStreamContext)
    """Create the stream, or add our subjects to it; never drop anyone else's."""
    refusal: Exception | None = None
    for _ in range(DECLARE_ATTEMPTS):
        try:
            info = await js.stream_info(name)
        except NotFoundError:
            try:
                await js.add_stream(name=name, subjects=subjects)
            except BadRequestError as error:  # created meanwhile, or a subject taken elsewhere
                refusal = error
                continue
            return
        present = list(info.config.subjects or [])
        if set(subjects) <= set(present):
            return
        info.config.subjects = sorted({*present, *subjects})
        try:
            await js.update_stream(config=info.config)
        except BadRequestError as error:
            refusal = error
    msg = f"NATS stream {name} could not be given the subjects {subjects}: {refusal}"
    raise RuntimeError(msg)


async def refresh_consumer(js: Any, stream: str, durable: str) -> None:  # noqa: ANN401
    """Bring an existing durable consumer to the current settings.

    FastStream creates a missing durable consumer but leaves an existing one as it was: one an
    earlier version created with ``max_deliver`` (the limit plus two) would still drop a message
    whose dead-letter copy is refused (see the module). ``max_deliver`` and ``ack_wait`` are
    editable on a live consumer."""
    try:
        info = await js.consumer_info(stream, durable)
    except NotFoundError:
        return  # created with the current settings when it starts
    wanted = {"max_deliver": UNLIMITED_DELIVERIES, "ack_wait": float(ACK_WAIT_SECONDS)}
    current = {"max_deliver": info.config.max_deliver, "ack_wait": info.config.ack_wait}
    if current != wanted:
        info.config.max_deliver = wanted["max_deliver"]
        info.config.ack_wait = wanted["ack_wait"]
        await js.add_consumer(stream, config=info.config)


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` is one token, a final ``>`` one or more."""
    wanted, parts = pattern.split("."), subject.split(".")
    for index, part in enumerate(wanted):
        if part == ">":
            return len(parts) > index
        if index >= len(parts) or part not in ("*", parts[index]):
            return False
    return len(wanted) == len(parts)


def reads(config: Any, subject: str) -> bool:  # noqa: ANN401 (nats' ConsumerConfig)
    """True when a JetStream consumer with ``config`` is given messages published on ``subject``
    (no filter: every subject of its stream)."""
    filters = [f for f in [config.filter_subject, *(getattr(config, "filter_subjects", None) or [])] if f]
    return not filters or any(subject_matches(f, subject) for f in filters)


class NatsTransport(FastStreamTransport):
    label = "NATS"
    metrics_middleware = NatsPrometheusMiddleware
    broker: NatsBroker

    def __init__(
        self, settings: MessageBusSettings, names: EndpointNames, registry: MessageRegistry, signer: Signer
    ) -> None:
        super().__init__(settings, names, signer)
        self.broker = NatsBroker(
            settings.url or "nats://localhost:4222", logger=BROKER_LOG, apply_types=False
        )
        self._events = names.stream("events")
        self._dead_letters = names.stream("dead_letters")
        self._subjects = sorted({names.channel(e.message_name) for e in registry.classes(IntegrationEvent)})
        self._known = KnownConsumers()

    def listen(self, consumer: Consumer[Any], handler: DeliveryHandler) -> None:
        subject = self.names.channel(consumer.event_type.message_name)
        broker = self.broker
        dlq_subject = self.names.dead_letter_subject(consumer.name)
        delay = self._settings.redelivery_delay_seconds
        longest_delay = delay * 2 ** (self._settings.max_delivery_attempts - 1)

        @broker.subscriber(
            subject,
            stream=JStream(self._events, declare=False),
            durable=durable_name(self.names.queue(consumer.name)),
            pull_sub=PullSub(batch_size=10, timeout=1.0),
            config=ConsumerConfig(
                max_deliver=UNLIMITED_DELIVERIES,
                ack_wait=ACK_WAIT_SECONDS,
                filter_subject=subject,
            ),
            ack_policy=AckPolicy.MANUAL,
            decoder=the_message,
        )
        async def on_message(message: NatsMessage) -> None:
            await handler(
                NatsDelivery(
                    message,
                    broker,
                    dlq_subject=dlq_subject,
                    dlq_stream=self._dead_letters,
                    delay=delay,
                    longest_delay=longest_delay,
                    publish_timeout=self._settings.publish_timeout_seconds,
                )
            )

    def _jetstream(self) -> Any:  # noqa: ANN401 (nats' JetStreamContext)
        return self.broker.config.connection_state.stream

    async def declare(self, consumers: Sequence[Consumer[Any]]) -> None:
        if self._subjects:
            await ensure_stream(self._jetstream(), self._events, self._subjects)
        await ensure_stream(self._jetstream(), self._dead_letters, [f"dlq.{self.names.queue('')}>"])
        for consumer in consumers:
            durable = durable_name(self.names.queue(consumer.name))
            await refresh_consumer(self._jetstream(), self._events, durable)

    async def drop_topology(self, consumers: Sequence[Consumer[Any]]) -> None:
        del consumers  # their durable consumers go with the stream
        js = self.broker.config.connection_state.stream
        for name in (self._events, self._dead_letters):
            try:
                await js.delete_stream(name)
            except NotFoundError:
                continue

    async def read_dead_letters(self, consumer: Consumer[Any], limit: int) -> list[DeadLetterCopy]:
        js = self.broker.config.connection_state.stream
        subject = self.names.dead_letter_subject(consumer.name)
        info = await js.stream_info(self._dead_letters)
        copies: list[DeadLetterCopy] = []
        if not info.state.messages:
            return copies
        for sequence in range(max(info.state.first_seq, 1), info.state.last_seq + 1):
            if len(copies) >= limit:
                break
            try:
                message = await js.get_msg(self._dead_letters, sequence)
            except NotFoundError:
                continue
            if message.subject == subject:
                copies.append(DeadLetterCopy(as_text(message.headers or {}), message.data or b""))
        return copies

    def is_outage(self, error: BaseException) -> bool:
        return isinstance(error, (ConnectionClosedError, NoServersError, ServiceUnavailableError))

    async def ping(self) -> None:
        """One round trip to the server (see the module): raises unless it answers; the caller
        bounds the wait (``API__READINESS_TIMEOUT_SECONDS``)."""
        if not self.broker.connection.is_connected:
            msg = "NATS: not connected (connecting again)"
            raise PingFailedError(msg)
        await self._jetstream().account_info()

    async def send(self, envelope: Envelope, headers: dict[str, str]) -> Unrouted | None:
        """A JetStream publish (acknowledged by the stream); :class:`Unrouted` when no consumer
        of the stream filters the subject yet (the message stays in the stream, and a durable
        consumer created later reads it from the stream's start)."""
        subject = self.names.channel(envelope.event_name)
        await self.broker.publish(
            envelope.body,
            subject,
            headers=headers | {"Nats-Msg-Id": envelope.message_id},
            stream=self._events,
            timeout=self._settings.publish_timeout_seconds,
        )

        async def has_consumer() -> bool:
            consumers = await self._jetstream().consumers_info(self._events)
            return any(reads(info.config, subject) for info in consumers)

        detail = f"no consumer of stream {self._events} reads subject {subject} yet; the message stays there"
        return await self._known.unrouted(subject, has_consumer, detail)

    def telemetry_middleware(self, tracer_provider: TracerProvider) -> Any:  # noqa: ANN401
        from faststream.nats.opentelemetry import NatsTelemetryMiddleware  # noqa: PLC0415

        return NatsTelemetryMiddleware(tracer_provider=tracer_provider)
