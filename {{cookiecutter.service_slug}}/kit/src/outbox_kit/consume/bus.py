"""The buses: FastStream over a broker, and the in-process bus.

The in-process transport: integration events delivered to this process's consumers.

It needs no server, so it is the embedded default. Every consumer of the event runs through the
same consume pipeline a broker delivery uses (signature, context restore, inbox); if one fails,
the others still run and the publish raises, so the outbox row is retried (the inbox skips the
consumers that already succeeded, when it is enabled). An event no consumer in the process
takes is :class:`~outbox_kit.transports.bus.Unrouted`, as on a broker with nothing bound.
Each consumer's handler is limited to ``MESSAGE_BUS__HANDLER_TIMEOUT_SECONDS`` (the pipeline's
limit, as on a broker; never its commit):
one that hangs fails like any other and the next consumer still runs, before the delivery's own
(longer) limit ends the publish; and without the outbox, the request that committed the event
returns.

The raised :class:`ConsumerFailedError` is chained to a consumer's own error (``__cause__``): the
processor reads the chain to tell a database outage, which it releases the row for uncharged,
from a failure it charges as a retry. When several consumers failed, an outage is chosen as the
cause: the database was unreachable for this delivery, so no failure of it says anything about
the row yet (the next delivery, with the database back, charges a genuine failure).

The FastStream transport: RabbitMQ, Kafka, NATS JetStream or Redis Streams at run time.

Publishing is what the outbox processor calls; it returns only when the broker has durably
accepted the message (RabbitMQ: persistent + confirmed + mandatory; NATS: JetStream ack; Redis:
XADD reply; Kafka: ``acks=all``).

Consuming goes through one wrapper per message (``subscribers``); holding a message through a
database outage and keeping it alive at the broker is ``subscribers``' too."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from outbox_kit.application.handlers import HandlerRegistry
from outbox_kit.application.messages import MessageRegistry, UnknownMessageError
from outbox_kit.application.observability import RelayMetrics
from outbox_kit.consume.inbox import ConsumePipeline
from outbox_kit.consume.subscribers import ConsumeWrapper
from outbox_kit.persistence.database import is_database_outage
from outbox_kit.transports.base import BrokerTransport, DeadLetterCopy
from outbox_kit.transports.bus import BrokerUnavailableError, PublishResult, Unrouted
from outbox_kit.transports.envelope import Envelope, Signer, cloud_event_headers
from outbox_kit.transports.settings import EndpointNames, MessageBusSettings, Transport

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider


log = logging.getLogger(__name__)


class ConsumerFailedError(RuntimeError):
    """At least one in-process consumer failed; the outbox retries the message."""


class InProcessBus:
    """Delivers straight to the consume pipeline."""

    name = "inprocess"

    def __init__(
        self,
        *,
        handlers: HandlerRegistry,
        registry: MessageRegistry,
        pipeline: ConsumePipeline,
        signer: Signer,
    ) -> None:
        self._handlers = handlers
        self._registry = registry
        self._pipeline = pipeline
        self._signer = signer

    async def start(self) -> None:
        return None

    async def start_consuming(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def ping(self) -> None:
        return None

    async def publish(self, envelope: Envelope) -> Unrouted | None:
        event_type = self._registry.names.get(envelope.event_name)
        if event_type is None:
            msg = f"no registered message is named {envelope.event_name!r}"
            raise UnknownMessageError(msg)
        consumers = self._handlers.consumers_of(event_type)
        if not consumers:
            return Unrouted(f"no consumer of {envelope.event_name} in this process; nothing was delivered")
        headers = self._signer.sign(envelope.headers(), envelope.body)
        failures: dict[str, Exception] = {}
        for consumer in consumers:
            try:
                await self._pipeline.consume(consumer, headers, envelope.body)
            except Exception as error:  # noqa: BLE001 (reported together below)
                log.warning("consumer %s failed on %s: %r", consumer.name, envelope.message_id, error)
                failures[consumer.name] = error
        if failures:
            errors = list(failures.values())
            cause = next((error for error in errors if is_database_outage(error)), errors[0])
            described = "; ".join(f"{name}: {type(e).__name__}: {e}" for name, e in failures.items())
            raise ConsumerFailedError(described) from cause
        return None

    async def publish_batch(self, envelopes: Sequence[Envelope], window: int) -> list[PublishResult]:
        """One after another (the consumers run in this process): each message's outcome."""
        del window
        results: list[PublishResult] = []
        for envelope in envelopes:
            try:
                results.append(await self.publish(envelope))
            except Exception as error:  # noqa: BLE001 (the message's outcome, as on a broker)
                results.append(error)
        return results


OUTAGES = (ConnectionError, TimeoutError, OSError)


def build_transport(
    settings: MessageBusSettings, names: EndpointNames, registry: MessageRegistry
) -> BrokerTransport:
    """Import only the chosen broker's client library."""
    if settings.transport is Transport.RABBITMQ:
        from outbox_kit.transports.rabbit import RabbitTransport  # noqa: PLC0415

        return RabbitTransport(settings, names, registry)
    if settings.transport is Transport.NATS:
        from outbox_kit.transports.nats import NatsTransport  # noqa: PLC0415

        return NatsTransport(settings, names, registry)
    if settings.transport is Transport.REDIS:
        from outbox_kit.transports.redis import RedisTransport  # noqa: PLC0415

        return RedisTransport(settings, names, registry)
    if settings.transport is Transport.KAFKA:
        from outbox_kit.transports.kafka import KafkaTransport  # noqa: PLC0415

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
        self._source = f"/{namespace}"  # a CloudEvent's source: the service that published it
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

    async def publish(self, envelope: Envelope) -> Unrouted | None:
        (result,) = await self.publish_batch([envelope], 1)
        if isinstance(result, BaseException):
            raise result
        return result

    async def publish_batch(self, envelopes: Sequence[Envelope], window: int) -> list[PublishResult]:
        """Sign each envelope and publish them together; an outage becomes
        :class:`BrokerUnavailableError` (the circuit breaker's), any other error stays the message's."""
        messages = [(envelope, self._headers(envelope)) for envelope in envelopes]
        try:
            results = await self.transport.publish_batch(messages, window)
        except Exception as error:  # noqa: BLE001 (before any message: the batch's channel, say)
            return [self._classified(error)] * len(messages)
        return [
            self._classified(result) if isinstance(result, BaseException) else result for result in results
        ]

    def _headers(self, envelope: Envelope) -> dict[str, str]:
        headers = self._signer.sign(envelope.headers(), envelope.body)
        headers.update(
            cloud_event_headers(envelope, source=self._source, prefix=self.transport.cloud_events_prefix)
        )
        return headers

    def _classified(self, error: BaseException) -> BaseException:
        if isinstance(error, OUTAGES) or self.transport.is_outage(error):
            outage = BrokerUnavailableError(f"{self.name} is unreachable: {type(error).__name__}: {error}")
            outage.__cause__ = error
            return outage
        return error
