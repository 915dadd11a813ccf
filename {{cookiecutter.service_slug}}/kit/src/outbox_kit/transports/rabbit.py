"""RabbitMQ: a topic exchange per namespace, a quorum queue per consumer, a TTL retry queue.

A message being consumed carries its attempt (read from ``x-death`` and ``x-delivery-count``),
is retried through the TTL queue, and ends, past its attempts, as a dead-letter copy.

**Topology** per consumer (declared at start-up): the main quorum queue dead-letters rejected
messages into ``<queue>.retry``, whose TTL (``MESSAGE_BUS__REDELIVERY_DELAY_SECONDS``)
dead-letters them back to the main queue; final failures go to ``<queue>.dlq``. The attempt
number is read from ``x-death`` (plus ``x-delivery-count``, which a quorum queue adds after a
crash). Publishes are persistent, confirmed and mandatory on a channel that raises on return. A
publish no consumer queue is bound for comes back ``NO_ROUTE``: it is no failure but a delivery
to nobody (an event published before its first consumer exists), so a copy is kept in
``<namespace>.unrouted`` for an operator to read or shovel, and the publish answers
:class:`~outbox_kit.transports.bus.Unrouted`. Detecting it by the return, rather than by an
alternate exchange on ``<namespace>.events``, keeps the exchange's arguments as every deployed
service declared them (RabbitMQ refuses a redeclaration with other arguments) and tells the
outbox which rows went nowhere.

RabbitMQ refuses to redeclare a queue with other arguments (``PRECONDITION_FAILED``), and the
retry queue's TTL is a setting: changing ``MESSAGE_BUS__REDELIVERY_DELAY_SECONDS`` after the
first deploy would stop the service at start-up with a bare channel error. The declaration turns
that into one line naming the queue, the setting and the safe way out.

Readiness (``ping``) asks the broker itself: a passive declare of the service's exchange on a
channel of the probe's own. FastStream's ``ping`` reads the client's ``connected`` flag, which
stays set on a line gone silent (measured: ``bus: ok`` for three minutes of a black-holed
connection, while nothing was delivered); aio-pika's robust channel answers a repeated passive
declare from its cache, so the probe talks to the channel beneath it. A probe channel that failed
is dropped (aiormq closes a channel whose call was cancelled) and the next probe opens another,
so a failed probe never closes the channel FastStream publishes on.

Each consumer's prefetch is twice what it can work on at once (``MESSAGE_BUS__CONSUME_BATCH_SIZE``
times ``MESSAGE_BUS__CONSUME_CONCURRENCY``, so 256 by default): without a prefetch RabbitMQ
pushes a whole backlog into the process, which holds every message in memory (a million waiting
messages, a million in the process) and keeps none of them for another replica. Twice, so that
the next batches are already in the process while one is acknowledged (with exactly what it can
work on, the consumer waited for the broker after each batch: about 10% more CPU per message in
`make bench`'s end to end)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, cast

from aiormq.exceptions import (
    AMQPConnectionError,
    ChannelInvalidStateError,
    ChannelPreconditionFailed,
    ConnectionClosed,
    PublishError,
)
from faststream import AckPolicy
from faststream.rabbit import ExchangeType, QueueType, RabbitBroker, RabbitExchange, RabbitQueue
from faststream.rabbit.annotations import RabbitMessage
from faststream.rabbit.message import RabbitMessage as RabbitMessageType
from faststream.rabbit.prometheus import RabbitPrometheusMiddleware
from faststream.rabbit.schemas import Channel
from pamqp.commands import Basic
from pamqp.encode import field_table

from outbox_kit.application.handlers import Consumer
from outbox_kit.application.messages import MessageRegistry
from outbox_kit.transports.base import (
    BROKER_LOG,
    FastStreamTransport,
    PingFailedError,
    ReceivedMessage,
    publish_each,
)
from outbox_kit.transports.bus import PublishResult, Unrouted
from outbox_kit.transports.copies import CopyLimit, DeadLetterCopy, as_text, dead_letter_headers, publish_copy
from outbox_kit.transports.envelope import Envelope, RejectedMessageError, Rejection, Signer
from outbox_kit.transports.received import DeliveryHandler, broker_count, the_message
from outbox_kit.transports.settings import EndpointNames, MessageBusSettings

if TYPE_CHECKING:
    import aiormq
    from aio_pika import RobustExchange
    from aiormq.abc import AbstractChannel
    from opentelemetry.trace import TracerProvider
    from pamqp.common import FieldTable


DEFAULT_FRAME_MAX = 131_072  # RabbitMQ's, when the connection's negotiated value is not at hand
# Room in the content-header frame for what is not the header table: the frame's own fields and
# the other properties (content type, message id, delivery mode, ...).
PROPERTIES_ROOM = 1024
NO_ROUTE = 312  # Basic.Return's reply code: no queue is bound for the routing key
PERSISTENT = 2  # AMQP delivery mode: written to disk before the confirm


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

    async def ack(self) -> None:
        """``basic.ack`` handed to the connection's writer, not awaited to the socket (aiormq's
        default waits for the flush, a sixth of a consumed message's CPU). AMQP answers an ack
        with nothing either way: a connection lost before the frame leaves redelivers the
        message, and the inbox takes the copy for a duplicate."""
        raw = self._message.raw_message
        await raw.channel.basic_ack(delivery_tag=raw.delivery_tag, wait=False)

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


def is_no_route(error: PublishError) -> bool:
    """The broker returned the message because nothing is bound for it (not a refusal of it)."""
    return getattr(getattr(error.message, "delivery", None), "reply_code", None) == NO_ROUTE


class TopologyMismatchError(RuntimeError):
    """A queue exists on the broker with arguments other than the ones the settings give."""


MAX_PREFETCH = 65535  # AMQP's prefetch count is an unsigned short


class RabbitTransport(FastStreamTransport):
    label = "RabbitMQ"
    metrics_middleware = RabbitPrometheusMiddleware
    broker: RabbitBroker

    def __init__(
        self, settings: MessageBusSettings, names: EndpointNames, registry: MessageRegistry, signer: Signer
    ) -> None:
        super().__init__(settings, names, signer)
        del registry  # every event goes to the one exchange
        # A prefetch applies to each consumer of the channel on its own, and to no publish.
        prefetch = min(2 * settings.consume_batch_size * settings.consume_concurrency, MAX_PREFETCH)
        channel = Channel(on_return_raises=True, prefetch_count=prefetch)
        self.broker = RabbitBroker(
            settings.url, default_channel=channel, logger=BROKER_LOG, apply_types=False
        )
        self._exchange = RabbitExchange(names.exchange(), type=ExchangeType.TOPIC, durable=True)
        self._declared: RobustExchange | None = None  # resolved on the first publish
        self._probe: AbstractChannel | None = None  # readiness's own channel (see the module)

    def _queues(self, consumer: Consumer[Any]) -> tuple[RabbitQueue, RabbitQueue, RabbitQueue]:
        main_name = self.names.queue(consumer.name)
        retry_name = self.names.retry_queue(consumer.name)
        main = RabbitQueue(
            main_name,
            durable=True,
            queue_type=QueueType.QUORUM,
            routing_key=self.names.channel(consumer.event_type.message_name),
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
        return main, retry, RabbitQueue(self.names.dead_letters(consumer.name), durable=True)

    def listen(self, consumer: Consumer[Any], handler: DeliveryHandler) -> None:
        main, _, dlq = self._queues(consumer)
        broker = self.broker
        timeout = self._settings.publish_timeout_seconds

        @broker.subscriber(main, self._exchange, ack_policy=AckPolicy.MANUAL, decoder=the_message)
        async def on_message(message: RabbitMessage) -> None:
            await handler(RabbitDelivery(message, broker, main.name, dlq.name, publish_timeout=timeout))

    def _unrouted_queue(self) -> RabbitQueue:
        # Bounded, the oldest copy dropped first (MESSAGE_BUS__UNROUTED_MAX_MESSAGES).
        return RabbitQueue(
            self.names.unrouted(),
            durable=True,
            arguments={"x-max-length": self._settings.unrouted_max_messages, "x-overflow": "drop-head"},
        )

    async def declare(self, consumers: Sequence[Consumer[Any]]) -> None:
        exchange = await self.broker.declare_exchange(self._exchange)
        await self._declare_queue(self._unrouted_queue())
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

    async def drop_topology(self, consumers: Sequence[Consumer[Any]]) -> None:
        for consumer in consumers:
            for queue in self._queues(consumer):
                declared = await self.broker.declare_queue(queue)
                await declared.delete(if_unused=False, if_empty=False)
        unrouted = await self.broker.declare_queue(self._unrouted_queue())
        await unrouted.delete(if_unused=False, if_empty=False)
        exchange = await self.broker.declare_exchange(self._exchange)
        await exchange.delete(if_unused=False)

    async def read_dead_letters(self, consumer: Consumer[Any], limit: int) -> list[DeadLetterCopy]:
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

    async def send(self, envelope: Envelope, headers: dict[str, str]) -> Unrouted | None:
        """One message: a batch of one (see :meth:`send_batch`)."""
        (result,) = await self.send_batch([(envelope, headers)], 1)
        if isinstance(result, BaseException):
            raise result
        return result

    async def send_batch(
        self, messages: Sequence[tuple[Envelope, dict[str, str]]], window: int
    ) -> list[PublishResult]:
        """Persistent, mandatory, confirmed publishes on the AMQP channel beneath FastStream's, to
        the exchange FastStream declared: each frame is queued for the socket without waiting for
        its flush (``wait=False``), and each publish then awaits its own confirm, so a batch is in
        flight together. Beneath the broker's ``publish`` (its command, per-publish middlewares and
        exchange lookup, and aio-pika's message building, were half of the relay's CPU per row),
        so FastStream's publish metrics are recorded here, under their own names. Without a
        connection (FastStream's ``TestRabbitBroker`` patches it away) the broker's own
        ``publish`` runs, so the test broker still routes the message."""
        timeout = self._settings.publish_timeout_seconds
        if self.broker._connection is None:  # noqa: SLF001 (FastStream's own test of it)
            return await publish_each(self.publish_through_broker, messages, window, timeout)
        # aio-pika's robust channel waits for a lost connection to come back: bounded like a
        # publish (a timeout is an outage of the batch, released uncharged).
        async with asyncio.timeout(timeout):
            exchange = self._declared or await self._resolve_exchange()
            # aiormq's channel (its abstract class does not declare ``wait``).
            channel = cast("aiormq.Channel", await exchange.channel.get_underlay_channel())
        name = self._exchange.name

        async def confirmed(envelope: Envelope, headers: dict[str, str]) -> Unrouted | None:
            routing_key = self.names.channel(envelope.event_name)
            properties = Basic.Properties(
                content_type="application/json",
                delivery_mode=PERSISTENT,
                headers=cast("FieldTable", headers),
                message_id=envelope.message_id,
                correlation_id=envelope.message_id,
                timestamp=datetime.now(UTC),
            )
            started, error = time.perf_counter(), cast("Exception | None", None)
            try:
                await channel.basic_publish(
                    envelope.body,
                    exchange=name,
                    routing_key=routing_key,
                    properties=properties,
                    mandatory=True,
                    timeout=timeout,
                    wait=False,
                )
            except PublishError as failed:
                if not is_no_route(failed):
                    error = failed
                    raise
                return await self._keep_unrouted(envelope, headers, routing_key)
            except Exception as failed:
                error = failed
                raise
            finally:
                seconds = time.perf_counter() - started
                self.count_published("rabbitmq", f"{name}.{routing_key}", seconds, error)
            return None

        # The time limit is aiormq's own, around the frame's queueing and the confirm's wait.
        return await publish_each(confirmed, messages, window, timeout_seconds=None)

    async def publish_through_broker(self, envelope: Envelope, headers: dict[str, str]) -> Unrouted | None:
        """The same message through FastStream's own ``broker.publish``: what the test broker
        routes, and the plain publish ``make bench`` reads the relay against."""
        await self.broker.publish(
            envelope.body,
            exchange=self._exchange,
            routing_key=self.names.channel(envelope.event_name),
            persist=True,
            mandatory=True,
            headers=dict[str, Any](headers),
            message_id=envelope.message_id,
            content_type="application/json",
            timeout=self._settings.publish_timeout_seconds,
        )
        return None

    async def _keep_unrouted(self, envelope: Envelope, headers: dict[str, str], routing_key: str) -> Unrouted:
        """Keep a copy of a message no queue was bound for in ``<namespace>.unrouted`` (declared
        at start), with where it was published to. A queue an operator deleted keeps nothing until
        the next start: the row is still a delivery to nobody, its note says "not kept"."""
        queue = self._unrouted_queue()
        nowhere = f"no queue is bound for routing key {routing_key} on exchange {self._exchange.name}"
        try:
            await self.broker.publish(
                envelope.body,
                queue=queue,
                headers={
                    **headers,
                    "x-unrouted-exchange": self._exchange.name,
                    "x-unrouted-routing-key": routing_key,
                },
                persist=True,
                mandatory=True,
                content_type="application/json",
                message_id=envelope.message_id,
                timeout=self._settings.publish_timeout_seconds,
            )
        except PublishError as failed:
            if not is_no_route(failed):
                raise
            return Unrouted(f"{nowhere}; not kept: queue {queue.name} is missing too")
        return Unrouted(f"{nowhere}; a copy is kept in queue {queue.name}")

    async def _resolve_exchange(self) -> RobustExchange:
        self._declared = await self.broker.declare_exchange(self._exchange)
        return self._declared

    async def ping(self) -> None:
        """One round trip to the broker (see the module): raises unless it answers; the caller
        bounds the wait (``API__READINESS_TIMEOUT_SECONDS``)."""
        try:
            channel = await self._probe_channel()
            await channel.exchange_declare(exchange=self._exchange.name, passive=True)
        except BaseException:
            self._probe = None  # closed by aiormq or the broker: the next probe opens another
            raise

    async def _probe_channel(self) -> AbstractChannel:
        connection = self.broker._connection  # noqa: SLF001 (FastStream keeps aio-pika's connection)
        transport = connection.transport if connection is not None else None
        if transport is None:
            msg = "RabbitMQ: no connection (connecting again)"
            raise PingFailedError(msg)
        probe = self._probe
        # A reconnect gives a new connection beneath aio-pika's: its channels are not the probe's.
        if probe is None or probe.is_closed or probe.connection is not transport.connection:
            probe = self._probe = await transport.connection.channel(publisher_confirms=False)
        return probe

    async def close(self) -> None:
        self._declared = None  # a new connection has channels of its own
        self._probe = None
        await super().close()

    def telemetry_middleware(self, tracer_provider: TracerProvider) -> Any:  # noqa: ANN401
        from faststream.rabbit.opentelemetry import RabbitTelemetryMiddleware  # noqa: PLC0415

        return RabbitTelemetryMiddleware(tracer_provider=tracer_provider)
