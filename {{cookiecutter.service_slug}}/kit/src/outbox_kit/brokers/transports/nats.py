"""NATS JetStream: one events stream, one durable pull consumer per consumer, a DLQ stream.

A failure is retried with ``nack(delay=...)`` (exponential from
``MESSAGE_BUS__REDELIVERY_DELAY_SECONDS``); JetStream's own ``max_deliver`` (the limit plus two)
is only the safety net for crash loops. Publishes go through JetStream (``stream=``), never core
NATS (a core publish to a subject no stream captures is silently lost), and carry
``Nats-Msg-Id`` so JetStream drops a duplicate publish within its dedup window.

Declaring a stream only ever adds subjects. Services that share a namespace share its events
stream, and during a rolling deploy the old and the new version both declare it: replacing the
subject list with our own would make the other side's publishes fail until it declares again.
The update keeps the stream's other settings (limits an operator set stay) and is re-checked,
because two services can merge at the same moment.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from faststream import AckPolicy
from faststream.nats import ConsumerConfig, JStream, NatsBroker, PullSub
from faststream.nats.annotations import NatsMessage
from faststream.nats.prometheus import NatsPrometheusMiddleware
from nats.errors import ConnectionClosedError, NoServersError
from nats.js.errors import NotFoundError, ServiceUnavailableError

from ...application.handler_types import Consumer
from ...application.messages import IntegrationEvent
from ...application.registry import MessageRegistry
from ...messaging.envelope import Envelope
from ...messaging.settings import MessageBusSettings
from ..naming import EndpointNames
from .base import BROKER_LOG, FastStreamTransport
from .headers import as_text, undecoded_body
from .nats_delivery import ACK_WAIT_SECONDS, NatsDelivery
from .nats_streams import durable_name, ensure_stream, refresh_consumer
from .ports import DeadLetterCopy, DeliveryHandler

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider


class NatsTransport(FastStreamTransport):
    label = "NATS"
    metrics_middleware = NatsPrometheusMiddleware
    broker: NatsBroker

    def __init__(self, settings: MessageBusSettings, names: EndpointNames, registry: MessageRegistry) -> None:
        self._settings = settings
        self._names = names
        self.broker = NatsBroker(settings.url or "nats://localhost:4222", logger=BROKER_LOG)
        self._events = names.stream("events")
        self._dead_letters = names.stream("dead_letters")
        self._subjects = sorted({names.channel(e.message_name) for e in registry.classes(IntegrationEvent)})

    def subscribe(self, consumer: Consumer[Any], handler: DeliveryHandler) -> None:
        subject = self._names.channel(consumer.event_type.message_name)
        broker = self.broker
        dlq_subject = self._names.dead_letter_subject(consumer.name)
        delay = self._settings.redelivery_delay_seconds

        @broker.subscriber(
            subject,
            stream=JStream(self._events, declare=False),
            durable=durable_name(self._names.queue(consumer.name)),
            pull_sub=PullSub(batch_size=10, timeout=1.0),
            config=ConsumerConfig(
                max_deliver=self._settings.max_delivery_attempts + 2,
                ack_wait=ACK_WAIT_SECONDS,
                filter_subject=subject,
            ),
            ack_policy=AckPolicy.MANUAL,
            decoder=undecoded_body,
        )
        async def on_message(message: NatsMessage) -> None:
            await handler(
                NatsDelivery(
                    message,
                    broker,
                    dlq_subject=dlq_subject,
                    dlq_stream=self._dead_letters,
                    delay=delay,
                    publish_timeout=self._settings.publish_timeout_seconds,
                )
            )

    def _jetstream(self) -> Any:  # noqa: ANN401 (nats' JetStreamContext)
        return self.broker.config.connection_state.stream

    async def declare(self, consumers: Sequence[Consumer[Any]]) -> None:
        if self._subjects:
            await ensure_stream(self._jetstream(), self._events, self._subjects)
        await ensure_stream(self._jetstream(), self._dead_letters, [f"dlq.{self._names.queue('')}>"])
        for consumer in consumers:
            durable = durable_name(self._names.queue(consumer.name))
            await refresh_consumer(
                self._jetstream(), self._events, durable, self._settings.max_delivery_attempts
            )

    async def delete_topology(self, consumers: Sequence[Consumer[Any]]) -> None:
        del consumers  # their durable consumers go with the stream
        js = self.broker.config.connection_state.stream
        for name in (self._events, self._dead_letters):
            try:
                await js.delete_stream(name)
            except NotFoundError:
                continue

    async def dead_letters(self, consumer: Consumer[Any], limit: int = 100) -> list[DeadLetterCopy]:
        js = self.broker.config.connection_state.stream
        subject = self._names.dead_letter_subject(consumer.name)
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

    async def publish(self, envelope: Envelope, headers: dict[str, str]) -> None:
        await self.broker.publish(
            envelope.body,
            self._names.channel(envelope.event_name),
            headers=headers | {"Nats-Msg-Id": envelope.message_id},
            stream=self._events,
            timeout=self._settings.publish_timeout_seconds,
        )

    def telemetry_middleware(self, tracer_provider: TracerProvider) -> Any:  # noqa: ANN401
        from faststream.nats.opentelemetry import NatsTelemetryMiddleware  # noqa: PLC0415

        return NatsTelemetryMiddleware(tracer_provider=tracer_provider)
