"""The FastStream transport: RabbitMQ, Kafka, NATS JetStream or Redis Streams at run time.

Publishing is what the outbox processor calls; it returns only when the broker has durably
accepted the message (RabbitMQ: persistent + confirmed + mandatory; NATS: JetStream ack; Redis:
XADD reply; Kafka: ``acks=all``).

Consuming goes through one wrapper per message (``consume``); holding a message through a
database outage and keeping it alive at the broker is ``holding``'s.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from ..application.handlers import HandlerRegistry
from ..application.registry import MessageRegistry
from ..inbox.pipeline import ConsumePipeline
from ..kernel.metrics import RelayMetrics
from ..messaging.envelope import Envelope
from ..messaging.outages import BrokerUnavailableError
from ..messaging.settings import MessageBusSettings, Transport
from ..messaging.signing import Signer
from .consume import ConsumeWrapper
from .naming import EndpointNames
from .transports.ports import BrokerTransport, DeadLetterCopy

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

log = logging.getLogger(__name__)
OUTAGES = (ConnectionError, TimeoutError, OSError)


def build_transport(
    settings: MessageBusSettings, names: EndpointNames, registry: MessageRegistry
) -> BrokerTransport:
    """Import only the chosen broker's client library."""
    if settings.transport is Transport.RABBITMQ:
        from .transports.rabbit import RabbitTransport  # noqa: PLC0415

        return RabbitTransport(settings, names, registry)
    if settings.transport is Transport.NATS:
        from .transports.nats import NatsTransport  # noqa: PLC0415

        return NatsTransport(settings, names, registry)
    if settings.transport is Transport.REDIS:
        from .transports.redis import RedisTransport  # noqa: PLC0415

        return RedisTransport(settings, names, registry)
    if settings.transport is Transport.KAFKA:
        from .transports.kafka import KafkaTransport  # noqa: PLC0415

        return KafkaTransport(settings, names, registry)
    msg = f"{settings.transport} is not a broker transport"
    raise ValueError(msg)


class FastStreamBus:
    """A MessageBus over a FastStream broker, with this service's consumers attached."""

    def __init__(
        self,
        *,
        settings: MessageBusSettings,
        namespace: str,
        handlers: HandlerRegistry,
        registry: MessageRegistry,
        pipeline: ConsumePipeline,
        signer: Signer,
        metrics: RelayMetrics,
        tracer_provider: TracerProvider | None = None,
    ) -> None:
        self.name = settings.transport.value
        self._settings = settings
        self._signer = signer
        self._pipeline = pipeline
        self._metrics = metrics
        self.names = EndpointNames(namespace, settings.preserve_default_endpoint_names)
        self.transport = build_transport(settings, self.names, registry)
        self.transport.count_in(metrics.registry)
        if tracer_provider is not None:
            self.transport.trace_consumes_with(tracer_provider)
        self._consumers = handlers.consumers
        wrapper = ConsumeWrapper(settings=settings, pipeline=pipeline, metrics=metrics)
        for consumer in self._consumers:
            self.transport.subscribe(consumer, wrapper.handler_for(consumer))

    @property
    def broker(self) -> Any:  # noqa: ANN401 (the FastStream broker, for TestBroker in tests)
        return self.transport.broker

    async def start(self) -> None:
        await self.transport.connect()
        await self.transport.declare(self._consumers)

    async def start_consuming(self) -> None:
        await self.transport.start_consuming()

    async def stop(self) -> None:
        await self.transport.close()

    async def ping(self) -> None:
        await self.transport.ping()

    async def delete_topology(self) -> None:
        """Remove this service's queues, streams and exchanges from the broker, messages included.

        For tests and for decommissioning a namespace; never called by the service itself.
        """
        await self.transport.connect()
        try:
            await self.transport.delete_topology(self._consumers)
        finally:
            await self.transport.close()

    async def dead_letters(self, consumer_name: str, limit: int = 100) -> list[DeadLetterCopy]:
        """The dead letters of one consumer (see each transport for the semantics)."""
        (consumer,) = [c for c in self._consumers if c.name == consumer_name]
        return await self.transport.dead_letters(consumer, limit)

    async def publish(self, envelope: Envelope) -> None:
        headers = self._signer.sign(envelope.headers(), envelope.body)
        try:
            async with asyncio.timeout(self._settings.publish_timeout_seconds):
                await self.transport.publish(envelope, headers)
        except Exception as error:
            if isinstance(error, OUTAGES) or self.transport.is_outage(error):
                msg = f"{self.name} is unreachable: {type(error).__name__}: {error}"
                raise BrokerUnavailableError(msg) from error
            raise
