"""RabbitMQ: a topic exchange per namespace, a quorum queue per consumer, a TTL retry queue.

Topology per consumer (declared at start-up): the main
quorum queue dead-letters rejected messages into ``<queue>.retry``, whose TTL
(``MESSAGE_BUS__REDELIVERY_DELAY_SECONDS``) dead-letters them back to the main queue; final
failures go to ``<queue>.dlq``. The attempt number is read from ``x-death`` (plus
``x-delivery-count``, which a quorum queue adds after a crash). Publishes are persistent,
confirmed and mandatory on a channel that raises on return: an unroutable message is a failure.

RabbitMQ refuses to redeclare a queue with other arguments (``PRECONDITION_FAILED``), and the
retry queue's TTL is a setting: changing ``MESSAGE_BUS__REDELIVERY_DELAY_SECONDS`` after the
first deploy would stop the service at start-up with a bare channel error. The declaration turns
that into one line naming the queue, the setting and the safe way out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from aiormq.exceptions import (
    AMQPConnectionError,
    ChannelInvalidStateError,
    ChannelPreconditionFailed,
    ConnectionClosed,
)
from faststream import AckPolicy
from faststream.rabbit import ExchangeType, QueueType, RabbitBroker, RabbitExchange, RabbitQueue
from faststream.rabbit.annotations import RabbitMessage
from faststream.rabbit.prometheus import RabbitPrometheusMiddleware
from faststream.rabbit.schemas import Channel

from ...application.handler_types import Consumer
from ...application.registry import MessageRegistry
from ...messaging.envelope import Envelope
from ...messaging.settings import MessageBusSettings
from ..naming import EndpointNames
from .base import BROKER_LOG, FastStreamTransport
from .headers import as_text, undecoded_body
from .ports import DeadLetterCopy, DeliveryHandler
from .rabbit_delivery import RabbitDelivery

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider


class TopologyMismatchError(RuntimeError):
    """A queue exists on the broker with arguments other than the ones the settings give."""


class RabbitTransport(FastStreamTransport):
    label = "RabbitMQ"
    metrics_middleware = RabbitPrometheusMiddleware
    broker: RabbitBroker

    def __init__(self, settings: MessageBusSettings, names: EndpointNames, registry: MessageRegistry) -> None:
        self._settings = settings
        self._names = names
        self._registry = registry
        self.broker = RabbitBroker(
            settings.url, default_channel=Channel(on_return_raises=True), logger=BROKER_LOG
        )
        self._exchange = RabbitExchange(names.exchange(), type=ExchangeType.TOPIC, durable=True)

    def _queues(self, consumer: Consumer[Any]) -> tuple[RabbitQueue, RabbitQueue, RabbitQueue]:
        main_name = self._names.queue(consumer.name)
        retry_name = self._names.retry_queue(consumer.name)
        main = RabbitQueue(
            main_name,
            durable=True,
            queue_type=QueueType.QUORUM,
            routing_key=self._names.channel(consumer.event_type.message_name),
            arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": retry_name},
        )
        retry = RabbitQueue(
            retry_name,
            durable=True,
            arguments={
                "x-message-ttl": int(self._settings.redelivery_delay_seconds * 1000),
                "x-dead-letter-exchange": "",
                "x-dead-letter-routing-key": main_name,
            },
        )
        return main, retry, RabbitQueue(self._names.dead_letters(consumer.name), durable=True)

    def subscribe(self, consumer: Consumer[Any], handler: DeliveryHandler) -> None:
        main, _, dlq = self._queues(consumer)
        broker = self.broker
        timeout = self._settings.publish_timeout_seconds

        @broker.subscriber(main, self._exchange, ack_policy=AckPolicy.MANUAL, decoder=undecoded_body)
        async def on_message(message: RabbitMessage) -> None:
            await handler(RabbitDelivery(message, broker, main.name, dlq.name, publish_timeout=timeout))

    async def declare(self, consumers: Sequence[Consumer[Any]]) -> None:
        exchange = await self.broker.declare_exchange(self._exchange)
        for consumer in consumers:
            main, retry, dlq = self._queues(consumer)
            for queue in (retry, dlq):
                await self._declare_queue(queue)
            declared = await self._declare_queue(main)
            await declared.bind(exchange, routing_key=main.routing_key)

    async def _declare_queue(self, queue: RabbitQueue) -> Any:  # noqa: ANN401 (aio-pika's queue)
        try:
            return await self.broker.declare_queue(queue)
        except ChannelPreconditionFailed as error:
            delay_ms = int(self._settings.redelivery_delay_seconds * 1000)
            hint = (
                f" Its x-message-ttl is MESSAGE_BUS__REDELIVERY_DELAY_SECONDS ({delay_ms} ms now): set "
                "the delay back to the value it was declared with, or let the queue empty and "
                f"delete it (rabbitmqctl delete_queue {queue.name} --if-empty) so it is declared anew."
                if queue.name.endswith(".retry")
                else " Delete or migrate it (its messages first) before changing how it is declared."
            )
            msg = f"RabbitMQ queue {queue.name} already exists with other arguments ({error}).{hint}"
            raise TopologyMismatchError(msg) from error

    async def delete_topology(self, consumers: Sequence[Consumer[Any]]) -> None:
        for consumer in consumers:
            for queue in self._queues(consumer):
                declared = await self.broker.declare_queue(queue)
                await declared.delete(if_unused=False, if_empty=False)
        exchange = await self.broker.declare_exchange(self._exchange)
        await exchange.delete(if_unused=False)

    async def dead_letters(self, consumer: Consumer[Any], limit: int = 100) -> list[DeadLetterCopy]:
        queue = await self.broker.declare_queue(self._queues(consumer)[2])
        copies = []
        for _ in range(limit):
            message = await queue.get(no_ack=True, fail=False)
            if message is None:
                break
            copies.append(DeadLetterCopy(as_text(message.headers or {}), message.body))
        return copies

    def is_outage(self, error: BaseException) -> bool:
        if isinstance(error, (AMQPConnectionError, ChannelInvalidStateError, ConnectionClosed)):
            return True
        # When a channel or connection closes without a reason, aiormq fails every pending
        # confirm with a bare ``Exception()`` (``FutureStore.reject_all(None)``): seen when the line
        # to the broker is cut mid-publish. Nothing else in a publish raises one.
        return type(error) is Exception and not error.args

    async def publish(self, envelope: Envelope, headers: dict[str, str]) -> None:
        await self.broker.publish(
            envelope.body,
            exchange=self._exchange,
            routing_key=self._names.channel(envelope.event_name),
            persist=True,
            mandatory=True,
            headers=dict[str, Any](headers),
            message_id=envelope.message_id,
            content_type="application/json",
            timeout=self._settings.publish_timeout_seconds,
        )

    def telemetry_middleware(self, tracer_provider: TracerProvider) -> Any:  # noqa: ANN401
        from faststream.rabbit.opentelemetry import RabbitTelemetryMiddleware  # noqa: PLC0415

        return RabbitTelemetryMiddleware(tracer_provider=tracer_provider)
