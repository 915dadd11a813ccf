"""OpenTelemetry tracing (``TELEMETRY__TRACING=otel``): one trace from the request's context
through the outbox row and the published message to the consumer, spans only where there is
work, failures marked. Spans go to the SDK's in-memory exporter instead of OTLP."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Annotated

import httpx
import pytest
import sqlalchemy as sa
from dependency_injector import providers
from fastapi import APIRouter, Depends
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from outbox_kit.application.context import (
    current_context,
)
from outbox_kit.application.logs import ContextFilter, JsonFormatter
from outbox_kit.application.tracing import OpenTelemetryTracing
from outbox_kit.application.tracing import SpanKind as KitSpanKind
from outbox_kit.persistence.tables import (
    OUTBOX_TABLE,
)
from outbox_kit.persistence.unit_of_work import SqlUnitOfWork, SqlUnitOfWorkFactory
from outbox_kit.runtime.container import OutboxContainer
from outbox_kit.runtime.http import units_of_work
from outbox_kit.testing.fixtures import ContainerFactory, acting_as, fetch, live_server
from outbox_kit.testing.harness import CounterChangedV1, install_kit

pytestmark = pytest.mark.integration

TRACE_ID = "a" * 32  # what acting_as() carries: 00-aaaa...-bbbb...-01
CALLER_SPAN_ID = "b" * 16


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    spans = InMemorySpanExporter()
    yield spans
    spans.shutdown()


def traced(make_container: ContainerFactory, exporter: InMemorySpanExporter) -> OutboxContainer:
    container = make_container(
        message_bus={"transport": "inprocess", "enable_outbox": True, "enable_inbox": True}
    )
    tracing = OpenTelemetryTracing(service_name="test", processor=SimpleSpanProcessor(exporter))
    container.tracing.override(providers.Object(tracing))
    return container


def named(exporter: InMemorySpanExporter, name: str) -> ReadableSpan:
    (span,) = [s for s in exporter.get_finished_spans() if s.name == name]
    return span


def span_id(span: ReadableSpan) -> str:
    assert span.context is not None
    return f"{span.context.span_id:016x}"


def traceparent_of(span: ReadableSpan) -> str:
    assert span.context is not None
    context = span.context
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


async def enqueue_one(container: OutboxContainer, value: int) -> None:
    with acting_as():
        async with container.units_of_work()() as uow:
            uow.enqueue(CounterChangedV1(counter_id="c-1", value=value))
            await uow.commit()


async def test_one_trace_runs_from_the_caller_through_the_outbox_to_the_consumer(
    make_container: ContainerFactory, exporter: InMemorySpanExporter
) -> None:
    container = traced(make_container, exporter)
    await install_kit(container)
    seen: list[str | None] = []

    async def observe(event: CounterChangedV1, uow: SqlUnitOfWork) -> None:
        del event, uow
        seen.append(current_context().traceparent)

    container.handlers().consume("kit.tracer", CounterChangedV1, observe)
    await enqueue_one(container, 1)
    outbox = container.sources()[0]
    await outbox.run_cycle()

    deliver = named(exporter, "outbox deliver kit.counter-changed.v1")
    consume = named(exporter, "consume kit.counter-changed.v1")
    assert deliver.context is not None
    assert consume.context is not None
    assert deliver.parent is not None
    assert consume.parent is not None
    assert f"{deliver.context.trace_id:032x}" == TRACE_ID == f"{consume.context.trace_id:032x}"
    assert f"{deliver.parent.span_id:016x}" == CALLER_SPAN_ID  # the request that wrote the row
    assert consume.parent.span_id == deliver.context.span_id  # the message carried the dispatch span
    assert (deliver.kind, consume.kind) == (SpanKind.PRODUCER, SpanKind.CONSUMER)
    assert consume.attributes is not None
    assert consume.attributes["inbox.outcome"] == "consumed"
    # What the handler writes next carries the consumer span: the trace continues.
    assert seen == [f"00-{TRACE_ID}-{span_id(consume)}-01"]

    exporter.clear()
    for _ in range(3):
        await outbox.run_cycle()  # idle polls
    assert exporter.get_finished_spans() == ()


async def test_a_failed_delivery_is_a_failed_span(
    make_container: ContainerFactory, exporter: InMemorySpanExporter
) -> None:
    container = traced(make_container, exporter)
    await install_kit(container)

    async def refuse(event: CounterChangedV1, uow: SqlUnitOfWork) -> None:
        del event, uow
        msg = "the consumer is down"
        raise RuntimeError(msg)

    container.handlers().consume("kit.refuser", CounterChangedV1, refuse)
    await enqueue_one(container, 2)
    await container.sources()[0].run_cycle()

    for name in ("outbox deliver kit.counter-changed.v1", "consume kit.counter-changed.v1"):
        span = named(exporter, name)
        assert span.status.status_code is StatusCode.ERROR, name
        assert "the consumer is down" in (span.status.description or ""), name
        assert [event.name for event in span.events] == ["exception"], name


def writing_router() -> APIRouter:
    """A route that writes an outbox row, as any command endpoint does."""
    router = APIRouter()

    @router.post("/traced/{value}", status_code=201)
    async def enqueue(value: int, units: Annotated[SqlUnitOfWorkFactory, Depends(units_of_work)]) -> None:
        async def operation(uow: SqlUnitOfWork) -> None:
            uow.enqueue(CounterChangedV1(counter_id="c-1", value=value))

        await units().run(operation)

    return router


async def test_a_request_is_a_server_span_whose_context_the_rows_it_writes_carry(
    make_container: ContainerFactory, exporter: InMemorySpanExporter
) -> None:
    """The OpenTelemetry FastAPI instrumentation opens the server span (named after the route,
    continuing the caller's trace); the outbox row the request writes carries that span, so the
    delivery that follows is its child. A request without a traceparent starts a trace."""
    container = traced(make_container, exporter)
    await install_kit(container)
    caller = f"00-{'c' * 32}-{'d' * 16}-01"
    async with (
        live_server(container, with_worker=False, routers=[writing_router()]) as base,
        httpx.AsyncClient(base_url=base) as client,
    ):
        continued = await client.post("/traced/1", headers={"traceparent": caller})
        fresh = await client.post("/traced/2")
    assert (continued.status_code, fresh.status_code) == (201, 201)

    first, second = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER]
    assert first.name == second.name == "POST /traced/{value}"
    assert first.context is not None
    assert first.parent is not None
    assert f"{first.context.trace_id:032x}" == "c" * 32
    assert f"{first.parent.span_id:016x}" == "d" * 16
    assert first.attributes is not None
    assert first.attributes["http.route"] == "/traced/{value}"
    assert second.parent is None  # no traceparent: a new trace starts here
    rows = await fetch(container, sa.select(OUTBOX_TABLE).order_by(OUTBOX_TABLE.c.seq))
    assert [row.trace_context for row in rows] == [traceparent_of(first), traceparent_of(second)]

    # The statements the request ran are client spans under it (the maintained SQLAlchemy
    # instrumentation); the outbox insert among them.
    statements = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.CLIENT]
    under_first = [
        s for s in statements if s.parent is not None and s.parent.span_id == first.context.span_id
    ]
    assert under_first, [s.name for s in statements]
    assert any("INSERT" in (s.attributes or {}).get("db.statement", "") for s in under_first)
    assert all(s.parent is not None for s in statements)  # none outside a traced span


async def test_the_probes_and_the_scrape_open_no_span(
    make_container: ContainerFactory, exporter: InMemorySpanExporter
) -> None:
    container = traced(make_container, exporter)
    async with live_server(container, with_worker=False) as base, httpx.AsyncClient(base_url=base) as client:
        for path in ("/livez", "/readyz", "/metrics", "/openapi.json"):
            assert (await client.get(path)).status_code == 200, path
    # /readyz ran its query outside any span: no statement span either.
    assert [s.name for s in exporter.get_finished_spans()] == ["GET /openapi.json"]


async def test_json_log_lines_name_the_trace_and_span_they_were_written_in(
    make_container: ContainerFactory, exporter: InMemorySpanExporter
) -> None:
    """With tracing on, every JSON line written inside a span carries its trace_id and span_id
    (a log line leads to its trace); a line outside any span carries neither."""
    container = traced(make_container, exporter)
    formatter, context = JsonFormatter(), ContextFilter()
    log = logging.getLogger("test.tracing")

    def line(message: str) -> dict[str, object]:
        record = log.makeRecord(log.name, logging.INFO, __file__, 1, message, (), None)
        context.filter(record)
        return json.loads(formatter.format(record))

    with container.tracing().span("work", kind=KitSpanKind.INTERNAL, traceparent=None) as span:
        inside = line("inside")
    outside = line("outside")
    assert span.traceparent is not None
    _, trace_id, span_id, _ = span.traceparent.split("-")
    assert (inside["trace_id"], inside["span_id"]) == (trace_id, span_id)
    assert "trace_id" not in outside
    assert "span_id" not in outside
