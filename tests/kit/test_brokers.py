"""Integration events across real brokers (RabbitMQ, Kafka, NATS JetStream, Redis Streams):
outbox -> processor -> broker -> consume pipeline -> inbox -> effect.

Kafka runs against whatever Kafka-protocol broker answers at ``TEST_KAFKA_URL``; Kafka's own
specifics (topics, commits, partitions) are in tests/integration/test_kafka.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from dependency_injector import providers
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from outbox_kit.application.context import capture_context, current_context
from outbox_kit.application.messages import (
    IntegrationEvent,
    MessageRegistry,
)
from outbox_kit.application.text import as_str
from outbox_kit.application.tracing import OpenTelemetryTracing, Tracing
from outbox_kit.consume.inbox import current_delivery
from outbox_kit.persistence.unit_of_work import SqlUnitOfWork
from outbox_kit.runtime.container import OutboxContainer
from outbox_kit.testing.brokers import LEFTOVERS
from outbox_kit.testing.fixtures import (
    SERVICE_URLS,
    acting_as,
    eventually,
    fresh_sqlite,
    kafka_broker_of_its_own,
    kit_container,
    make_settings,
)
from outbox_kit.testing.harness import (
    CONSUMER,
    CounterChangedV1,
    TcpProxy,
    install_kit,
    record_effect,
    tcp_proxy,
)
from outbox_kit.transports.envelope import Envelope, Signer
from outbox_kit.transports.nats import (
    NatsTransport,
)
from outbox_kit.transports.rabbit import (
    TopologyMismatchError,
)
from outbox_kit.transports.redis import (
    UNCOUNT,
    RedisDelivery,
)
from outbox_kit.transports.settings import (
    EndpointNames,
)
from sqlalchemy.engine import make_url

pytestmark = pytest.mark.integration
TRANSPORTS = [
    pytest.param("rabbitmq", marks=pytest.mark.rabbitmq),
    pytest.param("kafka", marks=pytest.mark.kafka),
    pytest.param("nats", marks=pytest.mark.nats),
    pytest.param("redis", marks=pytest.mark.redis),
]


@dataclass
class Observer:
    """A consumer that records what it saw and can be told to fail."""

    failures_left: int = 0
    seen: list[dict[str, Any]] = field(default_factory=list)
    takes_seconds: float = 0.0
    hangs_on: set[int] = field(default_factory=set)  # values whose handling never returns
    blocks_seconds: float = 0.0  # how long each run blocks the event loop (a CPU-bound stall)

    async def __call__(self, event: CounterChangedV1, uow: SqlUnitOfWork) -> None:
        context = current_context()
        self.seen.append(
            {
                "message_id": current_delivery().message_id,
                "tenant": context.tenant_id,
                "user": context.user_id,
                "roles": context.roles,
                "correlation": context.correlation_id,
                "traceparent": context.traceparent,
                "authentication": context.authentication_type,
                "value": event.value,
            }
        )
        time.sleep(self.blocks_seconds)
        if self.failures_left != 0:
            self.failures_left -= 1
            msg = f"observer failure, {self.failures_left} left"
            raise RuntimeError(msg)
        if event.value in self.hangs_on:
            await asyncio.Event().wait()  # never set
        await asyncio.sleep(self.takes_seconds)
        await record_effect(uow, f"consumed:{event.value}")


Start = Callable[..., Awaitable[tuple[OutboxContainer, Observer]]]


@pytest.fixture
async def start(tmp_path: Path, sqlite_template: Path) -> AsyncIterator[Start]:
    """Start a container with the kit's consumer on ``transport`` (worker included). Each one is
    a service of its own: its own SQLite database, so its own inbox and outbox."""
    running: list[OutboxContainer] = []

    async def starter(
        transport: str,
        *,
        namespace: str | None = None,
        failures: int = 0,
        signing: dict[str, str] | None = None,
        database_url: str | None = None,
        tracing: Tracing | None = None,
        message_bus: dict[str, Any] | None = None,
        observer: Observer | None = None,
    ) -> tuple[OutboxContainer, Observer]:
        home = tmp_path / f"service-{len(running)}"
        home.mkdir()
        settings = make_settings(
            database_url or fresh_sqlite(home, sqlite_template),
            application={"namespace": namespace or f"t{uuid.uuid4().hex[:10]}"},
            message_bus={
                "transport": transport,
                "url": SERVICE_URLS[transport],
                "max_delivery_attempts": 3,
                "redelivery_delay_seconds": 0.3,
                **({"signing_keys": signing, "signing_key_id": next(iter(signing))} if signing else {}),
                **(message_bus or {}),
            },
            outbox={"polling_interval_seconds": 0.2},
        )
        container = kit_container(settings)
        if tracing is not None:
            container.tracing.override(providers.Object(tracing))
        await install_kit(container)
        observer = observer or Observer(failures_left=failures)
        container.handlers().consume(CONSUMER, CounterChangedV1, observer)
        await container.bus().start()
        await container.worker().start()
        running.append(container)
        return container, observer

    yield starter
    for container in running:
        await container.worker().stop()
        await container.bus().delete_topology()  # type: ignore[attr-defined]  # leave the broker clean
        await container.database().dispose()


async def publish_through_outbox(container: OutboxContainer, value: int, **context: Any) -> None:
    with acting_as(**context):
        async with container.units_of_work()() as uow:
            uow.enqueue(CounterChangedV1(counter_id="c-1", value=value, aggregate_id="c-1"))
            await uow.commit()


async def effects_become(container: OutboxContainer, expected: list[str], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while (found := await effects_of(container)) != expected:
        if time.monotonic() > deadline:
            raise AssertionError(f"effects are {found}, expected {expected}")
        await asyncio.sleep(0.05)


async def effects_of(container: OutboxContainer) -> list[str]:
    from outbox_kit.testing.harness import effects

    async with container.database().session() as session:
        return await effects(session)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_the_senders_context_travels_across_the_broker(start: Start, transport: str) -> None:
    container, observer = await start(transport)
    await publish_through_outbox(
        container, 1, tenant="globex", user="bob", roles=("buyer", "vip"), correlation_id="c-42"
    )
    await eventually(lambda: len(observer.seen) == 1)
    (seen,) = observer.seen
    assert (seen["tenant"], seen["user"], seen["roles"], seen["correlation"]) == (
        "globex",
        "bob",
        ("buyer", "vip"),
        "c-42",
    )
    assert seen["authentication"] == "message"
    assert seen["traceparent"] == f"00-{'a' * 32}-{'b' * 16}-01"  # the writer's trace, carried on
    await effects_become(container, ["consumed:1"])
    await nothing_pending(container)  # the relay marks the row sent after the broker confirmed it


async def nothing_pending(container: OutboxContainer, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while (rows := await container.admin().count_pending("outbox"))[0].pending:
        if time.monotonic() > deadline:
            raise AssertionError(f"still pending: {rows}")
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_one_trace_crosses_the_broker_and_the_signed_traceparent_still_verifies(
    start: Start, transport: str
) -> None:
    """With tracing on, FastStream's telemetry middleware opens its ``process`` span around the
    consumed message, between the service's delivery span and its consume span: one trace from
    the writer to the handler. It opens nothing on the publish, which would have replaced the
    signed ``traceparent``: the message still verifies and is consumed."""
    exporter = InMemorySpanExporter()
    tracing = OpenTelemetryTracing(service_name="test", processor=SimpleSpanProcessor(exporter))
    container, observer = await start(transport, signing={"k1": "secret-one"}, tracing=tracing)
    await publish_through_outbox(container, 1)
    await effects_become(container, ["consumed:1"])

    def named(suffix: str) -> list[ReadableSpan]:
        return [span for span in exporter.get_finished_spans() if span.name.endswith(suffix)]

    # FastStream ends its span after the ack; the relay's delivery span may end later still (it
    # waits for the publish confirmation, which can come after the consumer's ack on a busy box).
    spans = (" process", "deliver kit.counter-changed.v1", "consume kit.counter-changed.v1")
    await eventually(lambda: all(len(named(suffix)) == 1 for suffix in spans))
    (deliver,), (process,), (consume,) = (
        named("deliver kit.counter-changed.v1"),
        named(" process"),
        named("consume kit.counter-changed.v1"),
    )
    assert {f"{span.context.trace_id:032x}" for span in (deliver, process, consume) if span.context} == {
        "a" * 32
    }
    assert deliver.parent is not None
    assert f"{deliver.parent.span_id:016x}" == "b" * 16  # the writer's span (acting_as)
    assert deliver.context is not None
    assert process.parent is not None
    assert process.parent.span_id == deliver.context.span_id
    assert process.context is not None
    assert consume.parent is not None
    assert consume.parent.span_id == process.context.span_id
    assert process.kind is SpanKind.CONSUMER
    assert process.attributes is not None
    assert process.attributes["messaging.system"] == transport
    assert named(" publish") == named(" create") == []  # the publish is the delivery span
    assert observer.seen[0]["traceparent"].startswith(f"00-{'a' * 32}-{consume.context.span_id:016x}-")  # type: ignore[union-attr]
    tracing.shutdown()


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_faststreams_broker_metrics_count_what_crossed_the_broker(start: Start, transport: str) -> None:
    """FastStream's own Prometheus middleware reports into the service's registry (the one
    ``/metrics`` serves), beside the relay's metrics: the relay's publish and the consumer's receipt."""
    container, observer = await start(transport)
    await publish_through_outbox(container, 1)
    await eventually(lambda: len(observer.seen) == 1)
    registry = container.metrics().registry

    def total(name: str) -> float:
        return sum(
            sample.value
            for metric in registry.collect()
            for sample in metric.samples
            if sample.name == name and sample.labels.get("broker") == transport
        )

    await eventually(lambda: total("faststream_received_processed_messages_total") >= 1)
    assert total("faststream_published_messages_total") >= 1
    assert total("faststream_received_messages_total") >= 1


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_context_with_non_ascii_values_travels_across_the_broker(
    start: Start, transport: str
) -> None:
    """Tenant and user names are not always ASCII; their signed headers must arrive intact."""
    container, observer = await start(transport)
    await publish_through_outbox(container, 2, tenant="zoë-gmbh", user="josé")
    await eventually(lambda: len(observer.seen) == 1)
    assert (observer.seen[0]["tenant"], observer.seen[0]["user"]) == ("zoë-gmbh", "josé")


def envelope(value: int, message_id: str | None = None) -> Envelope:
    with acting_as(tenant="acme"):
        context = capture_context()
    body = json.dumps(CounterChangedV1(counter_id="c", value=value).model_dump(mode="json")).encode()
    return Envelope(
        message_id or str(uuid.uuid4()), "kit.counter-changed.v1", datetime.now(UTC), body, context
    )


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_the_same_message_delivered_twice_has_one_effect(start: Start, transport: str) -> None:
    """The second copy reaches the consumer (on NATS past JetStream's own publish dedup, which
    drops a same-``Nats-Msg-Id`` publish) and the inbox skips it: one effect, one handler run."""
    container, observer = await start(transport)
    message = envelope(7)
    bus = container.bus()
    await bus.publish(message)
    await effects_become(container, ["consumed:7"])
    if transport == "nats":
        await bus.publish(message)  # dropped by JetStream: never reaches the consumer
        signed = container.signer().sign(message.headers(), message.body)
        await bus.broker.publish(  # type: ignore[attr-defined]
            message.body,
            bus.names.channel(message.event_name),  # type: ignore[attr-defined]
            headers=signed | {"Nats-Msg-Id": f"{message.message_id}-again"},
            stream=bus.names.stream("events"),  # type: ignore[attr-defined]
        )
    else:
        await bus.publish(message)  # a redelivery / a duplicate publish
    registry = container.metrics().registry
    await eventually(
        lambda: registry.get_sample_value("inbox_duplicates_total", {"consumer": CONSUMER}) == 1.0
    )
    assert await effects_of(container) == ["consumed:7"]
    assert len(observer.seen) == 1  # the inbox skipped the copy before the handler


async def publish_again(container: OutboxContainer, message: Envelope, transport: str) -> None:
    """Publish ``message`` once more, past JetStream's publish dedup on NATS (which drops a
    second publish with the same ``Nats-Msg-Id`` before any consumer sees it)."""
    bus = container.bus()
    if transport != "nats":
        await bus.publish(message)
        return
    signed = container.signer().sign(message.headers(), message.body)
    await bus.broker.publish(  # type: ignore[attr-defined]
        message.body,
        bus.names.channel(message.event_name),  # type: ignore[attr-defined]
        headers=signed | {"Nats-Msg-Id": f"{message.message_id}-{uuid.uuid4().hex[:8]}"},
        stream=bus.names.stream("events"),  # type: ignore[attr-defined]
    )


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_same_id_message_with_another_body_is_dead_lettered_as_a_conflicting_duplicate(
    start: Start, transport: str
) -> None:
    """Dedup is on the message id, but a second message under a processed id whose signed body
    differs is not a copy: it is dead-lettered (``conflicting_duplicate``) for someone to look
    at, never handled and never silently acknowledged; a true copy is still skipped."""
    container, observer = await start(transport)
    first = envelope(7)
    await container.bus().publish(first)
    await effects_become(container, ["consumed:7"])
    conflicting = envelope(8, message_id=first.message_id)
    await publish_again(container, conflicting, transport)
    letters: list[Any] = []
    deadline = time.monotonic() + 15
    while not letters and time.monotonic() < deadline:
        letters = await container.bus().dead_letters(CONSUMER)
        await asyncio.sleep(0.2)
    assert [letter.headers["x-message-id"] for letter in letters] == [first.message_id]
    assert "conflicting_duplicate" in letters[0].error
    registry = container.metrics().registry

    def conflicts() -> float | None:
        return registry.get_sample_value(
            "inbox_dead_letters_total", {"consumer": CONSUMER, "reason": "conflicting_duplicate"}
        )

    assert conflicts() == 1.0
    await publish_again(container, first, transport)  # a true copy: acknowledged and skipped
    await eventually(
        lambda: registry.get_sample_value("inbox_duplicates_total", {"consumer": CONSUMER}) == 1.0
    )
    assert await effects_of(container) == ["consumed:7"]
    assert [seen["value"] for seen in observer.seen] == [7]
    assert conflicts() == 1.0  # the copy was not taken for a conflict


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_failing_handler_is_redelivered_then_dead_lettered(start: Start, transport: str) -> None:
    container, observer = await start(transport, failures=-1)  # fails forever
    message = envelope(3)
    await container.bus().publish(message)
    await eventually(lambda: len(observer.seen) == 3, timeout=30)
    await asyncio.sleep(1.0)
    assert len(observer.seen) == 3, "delivered more often than MESSAGE_BUS__MAX_DELIVERY_ATTEMPTS"
    letters = await container.bus().dead_letters(CONSUMER)
    assert [letter.headers["x-message-id"] for letter in letters] == [message.message_id]
    assert "RuntimeError: observer failure" in letters[0].error
    assert letters[0].headers["x-attempts"] == "3"
    assert await effects_of(container) == []
    counted = container.metrics().registry.get_sample_value(
        "inbox_dead_letters_total", {"consumer": CONSUMER, "reason": "handler_failed"}
    )
    assert counted == 1.0


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_handler_that_never_returns_is_timed_out_redelivered_then_dead_lettered(
    start: Start, transport: str
) -> None:
    """``MESSAGE_BUS__HANDLER_TIMEOUT_SECONDS``: a handler that hangs on one message is a failed
    attempt once the limit ends; the consumer goes on with the next message (on Kafka, the next
    one of the same partition) and the hung one ends as a dead letter with the reason."""
    container, observer = await start(transport, message_bus={"handler_timeout_seconds": 1})
    observer.hangs_on = {1}
    hung = envelope(1)
    await container.bus().publish(hung)
    await eventually(lambda: len(observer.seen) == 1)
    await container.bus().publish(envelope(2))
    await effects_become(container, ["consumed:2"], timeout=30)
    letters: list[Any] = []
    deadline = time.monotonic() + 90  # three attempts of 1 s each and the redelivery delays
    while not letters and time.monotonic() < deadline:
        letters = await container.bus().dead_letters(CONSUMER)
        await asyncio.sleep(0.2)
    assert [letter.headers["x-message-id"] for letter in letters] == [hung.message_id]
    assert "handler timed out after 1 s" in letters[0].error
    # On Redis a copy the reclaimer takes while the timed-out attempt is still unwinding (a loaded
    # machine) is dropped unrun, and costs no attempt (transports/redis.py): exactly three runs.
    assert [seen["value"] for seen in observer.seen].count(1) == 3
    assert letters[0].headers["x-attempts"] == "3"
    assert await effects_of(container) == ["consumed:2"]


# The brokers running on this machine (Kafka's is started on demand): a dead-letter destination
# these tests can take away and give back, an event loop they can stall.
LOCAL_BROKERS = [
    pytest.param("rabbitmq", marks=pytest.mark.rabbitmq),
    pytest.param("nats", marks=pytest.mark.nats),
    pytest.param("redis", marks=pytest.mark.redis),
]


SCHEMAS = "schemas"
# A schema tansu checks each record ({"key": ..., "value": ...}) against: no record has no value.
REFUSE_EVERY_RECORD = {"type": "object", "properties": {"value": False}}


@pytest.fixture
def validating_kafka(tmp_path: Path) -> Iterator[Callable[[], str]]:
    """The address of a Kafka-protocol broker of the test's own that checks each produced record
    against ``<tmp_path>/schemas/<topic>.json``, started at the first call. Request it before
    ``start``: it then stops after the test's containers."""
    (tmp_path / SCHEMAS).mkdir()
    with contextlib.ExitStack() as running:

        def address() -> str:
            port = running.enter_context(kafka_broker_of_its_own(tmp_path, schemas=SCHEMAS))
            return f"127.0.0.1:{port}"

        yield address


async def refuse_dead_letters(
    container: OutboxContainer, transport: str, *, refuse: bool, home: Path | None = None
) -> None:
    """Take the consumer's dead-letter destination away (every copy is refused) or give it back:
    RabbitMQ's queue deleted (NO_ROUTE), NATS's stream deleted (no stream answers), Redis's
    stream key holding a string (WRONGTYPE), Kafka's topic given a schema no record meets (the
    broker of :func:`validating_kafka`, whose ``home`` is given, refuses each produce to it)."""
    bus = container.bus()
    names = bus.names  # type: ignore[attr-defined]
    if transport == "rabbitmq":
        import aio_pika

        connection = await aio_pika.connect(SERVICE_URLS["rabbitmq"])
        async with connection:
            channel = await connection.channel()
            if refuse:
                await channel.queue_delete(names.dead_letters(CONSUMER))
            else:
                await channel.declare_queue(names.dead_letters(CONSUMER), durable=True)
    elif transport == "nats":
        from outbox_kit.transports.nats import ensure_stream

        js = bus._jetstream()  # type: ignore[attr-defined]
        stream = names.stream("dead_letters")
        if refuse:
            await js.delete_stream(stream)
        else:
            await ensure_stream(js, stream, [f"dlq.{names.queue('')}>"])
    elif transport == "kafka":
        assert home is not None
        schema = home / SCHEMAS / f"{names.dead_letters(CONSUMER)}.json"
        if refuse:
            schema.write_text(json.dumps(REFUSE_EVERY_RECORD))
        else:
            schema.unlink()
    else:
        client = bus.broker.config.connection.client  # type: ignore[attr-defined]
        if refuse:
            await client.set(names.dead_letters(CONSUMER), "not a stream")
        else:
            await client.delete(names.dead_letters(CONSUMER))


@pytest.mark.parametrize("transport", [*LOCAL_BROKERS, pytest.param("kafka", marks=pytest.mark.kafka)])
async def test_a_failed_message_whose_dead_letter_copy_is_refused_ends_dead_lettered_once_it_is_taken(
    validating_kafka: Callable[[], str],
    start: Start,
    transport: str,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
) -> None:
    """Issue 34: the dead-letter destination is gone while a failing message uses its attempts.
    Each refused copy hands the message back to the broker; NATS used to stop redelivering after
    ``max_deliver`` (the limit plus two) and the message was lost. Kafka's hand-back published a
    retry copy but, the record having been sought back to, read the record again too: the
    handler ran past the limit and the copies multiplied. Now it is handed back for as long as
    its copy is refused, without running the handler again, and once the destination is back it
    ends there: one copy with the handler's error, after exactly the limit of runs."""
    caplog.set_level(logging.ERROR, logger="outbox_kit.consume.subscribers")
    bus = {"url": validating_kafka()} if transport == "kafka" else {}
    container, observer = await start(transport, failures=-1, message_bus=bus)

    def refusals() -> int:
        return sum("could not be dead-lettered" in record.getMessage() for record in caplog.records)

    await refuse_dead_letters(container, transport, refuse=True, home=tmp_path)
    message = envelope(3)
    await container.bus().publish(message)
    # Past the limit plus two deliveries, where JetStream used to give up on it.
    await eventually(lambda: refusals() >= 5, timeout=90)
    assert len(observer.seen) == 3, "the handler ran again past MESSAGE_BUS__MAX_DELIVERY_ATTEMPTS"
    await refuse_dead_letters(container, transport, refuse=False, home=tmp_path)
    letters: list[Any] = []
    deadline = time.monotonic() + 90
    while not letters and time.monotonic() < deadline:
        letters = await container.bus().dead_letters(CONSUMER)
        await asyncio.sleep(0.2)
    refused = refusals()
    await asyncio.sleep(3.0)  # a few more redelivery delays: nothing else may arrive
    later = await container.bus().dead_letters(CONSUMER)
    letters = letters + later if transport == "rabbitmq" else later  # RabbitMQ's are consumed when read
    assert [letter.headers["x-message-id"] for letter in letters] == [message.message_id]
    assert letters[0].error.startswith("RuntimeError: observer failure"), letters[0].error
    assert len(observer.seen) == 3
    assert refusals() == refused, "another copy of the message was still going round"
    counted = container.metrics().registry.get_sample_value(
        "inbox_dead_letters_total", {"consumer": CONSUMER, "reason": "handler_failed"}
    )
    assert counted == 1.0
    assert await effects_of(container) == []
    assert set((await LEFTOVERS[transport](container)).values()) == {0}  # nothing unacknowledged


@pytest.mark.parametrize("transport", LOCAL_BROKERS)
async def test_a_handler_that_stalls_the_event_loop_past_the_idle_time_runs_exactly_the_limit(
    start: Start, transport: str
) -> None:
    """Issue 34: a failing handler that blocks the event loop (CPU-bound, a long GC pause) for
    longer than the redelivery delay. On Redis the heartbeat cannot run, so the process's own
    reclaimer takes the entry (idle past ``min_idle_time``) as soon as the loop is free again; that
    copy is dropped unrun, but it used to count as a delivery, and the message was dead-lettered
    one run early. A dropped copy now costs no attempt: exactly the limit of runs, then one dead
    letter with ``x-attempts`` = the limit."""
    container, observer = await start(transport, failures=-1)
    observer.blocks_seconds = 1.0  # past the 0.3 s idle time after which Redis reclaims
    message = envelope(3)
    await container.bus().publish(message)
    letters: list[Any] = []
    deadline = time.monotonic() + 90
    while not letters and time.monotonic() < deadline:
        letters = await container.bus().dead_letters(CONSUMER)
        await asyncio.sleep(0.2)
    assert [letter.headers["x-message-id"] for letter in letters] == [message.message_id]
    assert letters[0].error.startswith("RuntimeError: observer failure"), letters[0].error
    assert letters[0].headers["x-attempts"] == "3"
    assert len(observer.seen) == 3


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_handler_that_recovers_has_exactly_one_effect(start: Start, transport: str) -> None:
    container, observer = await start(transport, failures=2)
    await container.bus().publish(envelope(5))
    await effects_become(container, ["consumed:5"], timeout=30)
    assert len(observer.seen) == 3
    assert await container.bus().dead_letters(CONSUMER) == []


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_message_with_a_bad_or_missing_signature_is_never_processed(
    start: Start, transport: str
) -> None:
    container, observer = await start(transport)
    forged = envelope(666)
    forger = Signer({"test": "not-the-real-secret"}, "test", allow_unsigned=False)
    transport_: Any = container.bus()
    await transport_.send(forged, forger.sign(forged.headers(), forged.body))
    unsigned = envelope(667)
    await transport_.send(unsigned, unsigned.headers())
    letters: list[Any] = []
    deadline = time.monotonic() + 15
    while len(letters) < 2 and time.monotonic() < deadline:
        letters += await container.bus().dead_letters(CONSUMER)
        await asyncio.sleep(0.2)
    assert observer.seen == []
    errors = {letter.headers["x-message-id"]: letter.error for letter in letters}
    assert "bad_signature" in errors[forged.message_id]
    assert "unsigned" in errors[unsigned.message_id]


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_an_oversized_header_is_dead_lettered_unprocessed(start: Start, transport: str) -> None:
    """Correctly signed, but one context header is beyond its limit: never restored, never
    handled, dead-lettered with the reason (a flood of roles cannot reach the handler)."""
    container, observer = await start(transport)
    message = envelope(668)
    headers = message.headers() | {"x-user-roles": ",".join(f"role-{i}" for i in range(2000))}
    signed = container.signer().sign(headers, message.body)
    await container.bus().send(message, signed)  # type: ignore[attr-defined]
    letters: list[Any] = []
    deadline = time.monotonic() + 15
    while not letters and time.monotonic() < deadline:
        letters = await container.bus().dead_letters(CONSUMER)
        await asyncio.sleep(0.2)
    assert observer.seen == []
    assert [letter.headers["x-message-id"] for letter in letters] == [message.message_id]
    assert "oversized_header" in letters[0].error
    assert "x-user-roles is longer than" in letters[0].error
    counted = container.metrics().registry.get_sample_value(
        "inbox_dead_letters_total", {"consumer": CONSUMER, "reason": "oversized_header"}
    )
    assert counted == 1.0


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_message_older_than_the_inbox_retention_is_dead_lettered_as_stale(
    start: Start, transport: str
) -> None:
    """Correctly signed, but older than the inbox remembers (14 days by default): its inbox row
    may be purged, so a captured copy replayed now could not be recognised as a duplicate. It is
    dead-lettered (``stale``) through the broker's own dead-letter path, never handled; a message
    of the same age minus an hour is handled."""
    container, observer = await start(transport)
    now = datetime.now(UTC)
    stale = dataclasses.replace(envelope(669), occurred_on=now - timedelta(days=14, hours=1))
    recent = dataclasses.replace(envelope(670), occurred_on=now - timedelta(days=13, hours=23))
    await container.bus().publish(stale)
    await container.bus().publish(recent)
    await effects_become(container, ["consumed:670"], timeout=30)
    letters: list[Any] = []
    deadline = time.monotonic() + 15
    while not letters and time.monotonic() < deadline:
        letters = await container.bus().dead_letters(CONSUMER)
        await asyncio.sleep(0.2)
    assert [letter.headers["x-message-id"] for letter in letters] == [stale.message_id]
    assert "stale" in letters[0].error
    assert [seen["value"] for seen in observer.seen] == [670]
    counted = container.metrics().registry.get_sample_value(
        "inbox_dead_letters_total", {"consumer": CONSUMER, "reason": "stale"}
    )
    assert counted == 1.0


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_two_namespaces_on_one_broker_do_not_see_each_others_messages(
    start: Start, transport: str
) -> None:
    first, first_observer = await start(transport)
    _second, second_observer = await start(transport)
    await publish_through_outbox(first, 11)
    await effects_become(first, ["consumed:11"])
    await asyncio.sleep(1.0)
    assert len(first_observer.seen) == 1
    assert second_observer.seen == []  # its own inbox: a leaked copy would have run its handler


@pytest.mark.rabbitmq
async def test_an_unroutable_rabbitmq_publish_is_kept_in_the_unrouted_queue_not_dropped(start: Start) -> None:
    """NO_ROUTE (no queue bound for the event) is a delivery to nobody, not a failure and not a
    silent drop: the publish answers Unrouted and a copy waits in ``<namespace>.unrouted``, with
    where it was published to."""
    import aio_pika
    from outbox_kit.transports.bus import Unrouted

    container, _ = await start("rabbitmq")
    base = envelope(1)
    orphan = Envelope(base.message_id, "kit.nobody-listens.v1", base.occurred_on, base.body, base.context)
    bus = container.bus()
    unrouted = await bus.publish(orphan)
    assert isinstance(unrouted, Unrouted)
    assert bus.names.unrouted() in unrouted.detail  # type: ignore[attr-defined]
    connection = await aio_pika.connect(SERVICE_URLS["rabbitmq"])
    async with connection:
        channel = await connection.channel()
        queue = await channel.get_queue(bus.names.unrouted(), ensure=False)  # type: ignore[attr-defined]
        kept = await queue.get(timeout=5)
        await kept.ack()
    assert kept.body == orphan.body
    assert kept.headers["x-message-id"] == orphan.message_id
    assert kept.headers["x-unrouted-routing-key"] == bus.names.channel(orphan.event_name)  # type: ignore[attr-defined]
    assert await bus.publish(envelope(2)) is None  # the kit's event has a queue bound: routed


@pytest.mark.rabbitmq
async def test_the_unrouted_queue_keeps_only_the_newest_copies(sqlite_url: str) -> None:
    """A contract published for weeks before its first consumer must not fill the broker:
    ``<namespace>.unrouted`` keeps the newest ``MESSAGE_BUS__UNROUTED_MAX_MESSAGES`` copies, the
    oldest dropped first."""
    import aio_pika

    settings = make_settings(
        sqlite_url,
        application={"namespace": f"t{uuid.uuid4().hex[:10]}"},
        message_bus={"transport": "rabbitmq", "url": SERVICE_URLS["rabbitmq"], "unrouted_max_messages": 2},
    )
    container = kit_container(settings)
    await install_kit(container)
    bus = container.bus()
    await bus.start()
    orphans = [
        Envelope(e.message_id, "kit.nobody-listens.v1", e.occurred_on, e.body, e.context)
        for e in (envelope(41), envelope(42), envelope(43))
    ]
    try:
        for orphan in orphans:
            assert await bus.publish(orphan) is not None  # unrouted, kept
        connection = await aio_pika.connect(SERVICE_URLS["rabbitmq"])
        async with connection:
            channel = await connection.channel()
            queue = await channel.get_queue(bus.names.unrouted(), ensure=False)  # type: ignore[attr-defined]
            kept = []
            while (message := await queue.get(timeout=5, fail=False)) is not None:
                kept.append(message.headers["x-message-id"])
                await message.ack()
        assert kept == [orphans[1].message_id, orphans[2].message_id]
    finally:
        await bus.stop()
        await bus.delete_topology()  # type: ignore[attr-defined]
        await container.database().dispose()


@pytest.mark.rabbitmq
async def test_rabbitmq_publishes_are_persistent_with_the_message_id(sqlite_url: str) -> None:
    """What reaches the quorum queue is a persistent message (delivery mode 2: it survives a
    broker restart) with the outbox row id as its AMQP message id; read raw with aio-pika."""
    import aio_pika

    settings = make_settings(
        sqlite_url,
        application={"namespace": f"t{uuid.uuid4().hex[:10]}"},
        message_bus={"transport": "rabbitmq", "url": SERVICE_URLS["rabbitmq"]},
    )
    container = kit_container(settings)
    await install_kit(container)
    container.handlers().consume(CONSUMER, CounterChangedV1, Observer())
    bus = container.bus()
    await bus.start()  # declares the topology; nothing consumes
    message = envelope(31)
    try:
        await bus.publish(message)
        connection = await aio_pika.connect(SERVICE_URLS["rabbitmq"])
        async with connection:
            channel = await connection.channel()
            queue = await channel.get_queue(bus.names.queue(CONSUMER), ensure=False)  # type: ignore[attr-defined]
            received = await queue.get(timeout=5)
            await received.ack()
        assert received.delivery_mode is aio_pika.DeliveryMode.PERSISTENT
        assert received.message_id == message.message_id
        assert received.headers["x-message-id"] == message.message_id
    finally:
        await bus.stop()
        await bus.delete_topology()  # type: ignore[attr-defined]
        await container.database().dispose()


@pytest.mark.rabbitmq
async def test_a_changed_retry_delay_is_a_clear_start_up_error_on_rabbitmq(
    start: Start, sqlite_url: str
) -> None:
    """The retry queue was declared with a 0.3 s TTL; a deploy with another delay gets one line
    naming the queue, the setting and the way out, not a bare PRECONDITION_FAILED."""
    namespace = f"t{uuid.uuid4().hex[:10]}"
    await start("rabbitmq", namespace=namespace)
    settings = make_settings(
        sqlite_url,
        application={"namespace": namespace},
        message_bus={
            "transport": "rabbitmq",
            "url": SERVICE_URLS["rabbitmq"],
            "redelivery_delay_seconds": 0.5,
        },
    )
    redeployed = kit_container(settings)
    await install_kit(redeployed)
    redeployed.handlers().consume(CONSUMER, CounterChangedV1, Observer())
    bus = redeployed.bus()
    try:
        with pytest.raises(TopologyMismatchError) as refused:
            await bus.start()
    finally:
        await bus.stop()
        await redeployed.database().dispose()
    message = str(refused.value)
    assert re.search(
        rf"queue {namespace}\.consumer\.[\w.-]+\.retry already exists with other arguments", message
    )
    assert "MESSAGE_BUS__REDELIVERY_DELAY_SECONDS (500 ms now)" in message
    assert "--if-empty" in message


async def pending_entry(container: OutboxContainer) -> dict[str, Any] | None:
    """The Redis pending-list entry of the observer's stream, if any (idle ms, delivery count)."""
    bus = container.bus()
    names = bus.names  # type: ignore[attr-defined]
    client = bus.broker.config.connection.client  # type: ignore[attr-defined]
    entries = await client.xpending_range(
        names.channel(CounterChangedV1.message_name), names.queue(CONSUMER), "-", "+", 10
    )
    assert len(entries) <= 1
    return dict(entries[0]) if entries else None


async def handler_started(observer: Observer) -> None:
    await eventually(lambda: len(observer.seen) >= 1, timeout=30)


@pytest.mark.redis
async def test_a_running_handler_keeps_its_redis_entry_fresh(start: Start) -> None:
    """Redis reclaims entries idle longer than the redelivery delay (0.3 s here); while a 3 s
    handler runs, its heartbeat (every 0.1 s) keeps resetting the entry's idle time and does not
    count as a delivery, so no other process takes it over."""
    container, observer = await start("redis")
    observer.takes_seconds = 3.0
    await container.bus().publish(envelope(8))
    await handler_started(observer)
    await asyncio.sleep(2.0)  # more than six redelivery delays into the handler
    entry = await pending_entry(container)
    assert entry is not None
    assert entry["time_since_delivered"] < 1500  # touched lately; untouched it would be over 2000
    assert entry["times_delivered"] < 5  # twenty touches so far, none counted as a delivery
    await effects_become(container, ["consumed:8"], timeout=30)
    assert len(observer.seen) == 1


@pytest.mark.redis
async def test_a_copy_reclaimed_while_its_handler_runs_is_dropped(
    start: Start, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With the heartbeat stalled (a starved event loop), the process's own reclaimer takes the
    entry back mid-handler; that copy is dropped, the running handler acks, the effect is once."""

    async def stalled(self: object) -> None:
        del self

    caplog.set_level(logging.INFO, logger="outbox_kit.transports.redis")
    monkeypatch.setattr(RedisDelivery, "touch", stalled)
    container, observer = await start("redis")
    observer.takes_seconds = 4.0
    await container.bus().publish(envelope(9))
    await handler_started(observer)

    def dropped() -> int:
        return sum("copy dropped" in record.getMessage() for record in caplog.records)

    await eventually(lambda: dropped() >= 1, timeout=3.5)  # mid-handler: it runs 4 s
    await effects_become(container, ["consumed:9"], timeout=30)
    await asyncio.sleep(0.7)  # two more redelivery delays: nothing left to reclaim
    assert len(observer.seen) == 1
    assert await pending_entry(container) is None  # acknowledged by the handler that ran


@pytest.mark.redis
async def test_a_dropped_redis_copy_gives_back_the_delivery_its_reclaim_counted(start: Start) -> None:
    """``UNCOUNT``, the script a dropped copy runs: the member's own reclaim is taken back (the
    count goes down by one, the entry stays this member's); an entry another member claimed
    meanwhile, or one already acknowledged, is left as it is."""
    container, _ = await start("redis")
    bus = container.bus()
    names = bus.names  # type: ignore[attr-defined]
    client = bus.broker.config.connection.client  # type: ignore[attr-defined]
    stream, group = f"{names.channel('uncount')}", names.queue("uncount")
    await client.xgroup_create(stream, group, id="0", mkstream=True)
    try:
        entry_id = await client.xadd(stream, {"k": "v"})
        await client.xreadgroup(group, "me", {stream: ">"})  # delivery 1
        await client.xclaim(stream, group, "me", 0, [entry_id])  # a reclaim: delivery 2

        async def uncount(member: str) -> tuple[str, int]:
            await client.eval(UNCOUNT, 1, stream, group, member, entry_id)
            (entry,) = await client.xpending_range(stream, group, "-", "+", 1)
            return as_str(entry["consumer"]), int(entry["times_delivered"])

        assert await uncount("me") == ("me", 1)
        assert await uncount("me") == ("me", 1)  # never below the one real delivery
        await client.xclaim(stream, group, "other", 0, [entry_id])  # another member's: delivery 2
        assert await uncount("me") == ("other", 2)
        await client.xack(stream, group, entry_id)
        await client.eval(UNCOUNT, 1, stream, group, "me", entry_id)
        assert await client.xpending_range(stream, group, "-", "+", 1) == []
    finally:
        await client.delete(stream)


@pytest.mark.nats
async def test_a_nats_consumer_an_earlier_version_capped_is_redeclared_without_max_deliver(
    start: Start, sqlite_url: str
) -> None:
    """Earlier versions created the durable consumer with ``max_deliver`` = the limit plus two,
    where JetStream dropped a message whose dead-letter copy was refused; the consumer now has
    none (the wrapper bounds the handler runs), and a redeploy lifts an existing cap."""
    namespace = f"t{uuid.uuid4().hex[:10]}"
    first, _ = await start("nats", namespace=namespace)
    events = first.bus().names.stream("events")  # type: ignore[attr-defined]
    js = first.bus().broker.config.connection_state.stream  # type: ignore[attr-defined]
    durable = re.sub(r"[^A-Za-z0-9_-]", "_", first.bus().names.queue(CONSUMER))  # type: ignore[attr-defined]
    info = await js.consumer_info(events, durable)
    assert info.config.max_deliver == -1
    info.config.max_deliver = 5  # as the earlier version declared it (3 attempts + 2)
    await js.add_consumer(events, config=info.config)
    assert (await js.consumer_info(events, durable)).config.max_deliver == 5
    settings = make_settings(
        sqlite_url,
        application={"namespace": namespace},
        message_bus={"transport": "nats", "url": SERVICE_URLS["nats"], "max_delivery_attempts": 6},
    )
    redeployed = kit_container(settings)
    await install_kit(redeployed)
    redeployed.handlers().consume(CONSUMER, CounterChangedV1, Observer())
    bus = redeployed.bus()
    try:
        await bus.start()
        assert (await js.consumer_info(events, durable)).config.max_deliver == -1
    finally:
        await bus.stop()
        await redeployed.database().dispose()


class InvoiceIssuedV1(IntegrationEvent, name="kit.invoice-issued.v1"):
    invoice_id: str


@pytest.mark.nats
async def test_services_sharing_a_nats_namespace_keep_each_others_subjects(sqlite_url: str) -> None:
    """Two services (or the old and new version in a rolling deploy) declare one events stream:
    each adds its subjects, neither drops the other's, and an operator's limit survives."""
    names = EndpointNames(f"t{uuid.uuid4().hex[:10]}")
    bus_settings = make_settings(
        sqlite_url, message_bus={"transport": "nats", "url": SERVICE_URLS["nats"]}
    ).message_bus
    transports = []
    for event in (CounterChangedV1, InvoiceIssuedV1):
        registry = MessageRegistry()
        registry.register(event)
        transports.append(NatsTransport(bus_settings, names, registry, Signer({}, None, allow_unsigned=True)))
    orders, billing = transports
    for transport in transports:
        await transport.connect()
    js = orders.broker.config.connection_state.stream
    stream = names.stream("events")
    expected = sorted(names.channel(e.message_name) for e in (CounterChangedV1, InvoiceIssuedV1))
    try:
        await orders.declare([])
        info = await js.stream_info(stream)
        info.config.max_msgs = 12345  # an operator's limit
        await js.update_stream(config=info.config)
        await billing.declare([])
        await orders.declare([])  # the old version restarts after the new one declared
        info = await js.stream_info(stream)
        assert sorted(info.config.subjects or []) == expected
        assert info.config.max_msgs == 12345
    finally:
        await orders.drop_topology([])
        for transport in transports:
            await transport.close()


@pytest.fixture
async def postgres_line(postgres_url: str) -> AsyncIterator[tuple[TcpProxy, str]]:
    """A cuttable line to the test's PostgreSQL database, and the URL that goes through it
    (requested before ``start``, so it outlives the started services' shutdown)."""
    url = make_url(postgres_url)
    async with tcp_proxy(url.host or "127.0.0.1", url.port or 5432) as proxy:
        yield proxy, url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)


@pytest.mark.redis
@pytest.mark.postgres
async def test_a_short_database_outage_dead_letters_nothing(
    postgres_line: tuple[TcpProxy, str], start: Start
) -> None:
    """The consumer's database goes away for longer than all its redelivery attempts take: the
    message is held (uncharged) instead of burning them, and runs once the database is back."""
    proxy, database_url = postgres_line
    container, observer = await start("redis", database_url=database_url)
    registry = container.metrics().registry

    def holds() -> float:
        return registry.get_sample_value("inbox_database_outage_holds_total", {"consumer": CONSUMER}) or 0.0

    await proxy.cut()
    await container.bus().publish(envelope(21))
    await eventually(lambda: holds() >= 3, timeout=30)  # 1.4 s held: past 3 attempts of 0.3 s
    assert observer.seen == []
    await proxy.start()
    await effects_become(container, ["consumed:21"], timeout=30)
    assert len(observer.seen) == 1
    assert await container.bus().dead_letters(CONSUMER) == []
