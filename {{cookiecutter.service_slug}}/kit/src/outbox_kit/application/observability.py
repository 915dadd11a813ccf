"""Tracing, metrics, logs and time: what every delivery is measured, traced, logged and limited by.

Time: the clock every part reads, and the time limit every delivery runs under.

Time as a dependency, so tests can move it and the code never calls ``datetime.now`` ad hoc.

The time limit of one delivery (a processor's row, an after-commit dispatch, a consumer's
handler run).

Without one, a handler that never returns holds its row or message for ever, and with it the
cycle, the partition or the consumer that waits for it. Past the limit the work is cancelled and
fails with :class:`TimeLimitExceededError`: a failure like any other, charged, retried with
backoff and dead-lettered at the attempt limit, its text ("delivery timed out after 60 s") in
``last_error`` or ``x-error``. One ``asyncio.timeout`` per delivery: no extra task.

A limit only helps where the work yields: a handler that blocks the event loop (CPU, a
synchronous call) cannot be interrupted by it.

Tracing and metrics: the tracing port with its pass-through default, and the relay's metrics.

Tracing: one span around each unit of delivery work, OpenTelemetry when switched on.

The service already carries a W3C ``traceparent`` from the HTTP request into the outbox row, from
the row onto the published message and from the message into what its consumer writes. With
``TELEMETRY__TRACING=otel`` each of those hops becomes a span that continues that trace:

* ``<method> <route>`` (server) around a request, child of the caller's ``traceparent``: made by
  the maintained OpenTelemetry FastAPI instrumentation (HTTP semantic conventions, the route
  template as the name); the request's context reads its ``traceparent`` (``active_traceparent``);
* ``<source> deliver <name>`` (producer for integration events, internal otherwise) around the
  delivery of one claimed row, outbox and internal commands alike (the shared polling core): the
  service's own span, because it is what the published message's signed ``traceparent`` names;
* ``<destination> process`` (consumer) around one message taken from a broker, made by
  FastStream's telemetry middleware (messaging semantic conventions), child of the message's
  ``traceparent``. It is installed for consuming only: on a publish it would replace the signed
  ``traceparent`` with its own and every signed message would fail verification;
* ``consume <name>`` (consumer) around the inbox and the handler, child of the span above (or of
  the message's ``traceparent`` on the in-process bus).

Each span's own context is what the next hop carries, so one trace runs from the request to the
last consumer. Spans exist only where there is work: an idle poll creates none (as it writes no
log line), so a quiet service does not flood the tracing backend; the probes and ``/metrics``
get no span either.

OpenTelemetry is an optional extra (``pip install '.[otel]'``): the default ``NoTracing`` imports
nothing and passes the incoming ``traceparent`` through unchanged. The exporter is OTLP, set up
by OpenTelemetry's own environment variables (``OTEL_EXPORTER_OTLP_ENDPOINT``,
``OTEL_SERVICE_NAME``...). The tracer provider belongs to the container, not to the process-wide
OpenTelemetry global, so tests and several containers in one process do not interfere.

No tracing (the default): nothing imported, nothing recorded, and the caller's traceparent
passed on untouched, so a trace that started upstream still runs through this service's rows and
messages.

Prometheus metrics of the relay: the polled tables (outbox, internal commands) and the inbox.

All metrics live in a registry owned by the container (no process-global registry), exposed at
``/metrics``. What to alert on: a growing
``outbox_oldest_pending_age_seconds``, any ``outbox_dead_letters_total`` increase, and a
``outbox_processor_heartbeat_timestamp_seconds`` that stops moving. The metric names keep their
``outbox_`` prefix for both polled tables (``source`` tells them apart): dashboards and alerts
depend on the names.

Logs: readable lines by default (control characters escaped, traceback lines indented, so a
value from outside cannot forge a record), JSON lines with LOGGING__JSON_FORMAT; both carry the
correlation id and tenant."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import inspect
import json
import logging
import sys
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider
from collections.abc import Iterable, Iterator
from functools import partial
from typing import TYPE_CHECKING, Any, cast

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from outbox_kit.application.context import RequestContext, current_context
from outbox_kit.application.scrubbing import Scrubber
from outbox_kit.application.text import escape_controls

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor
    from opentelemetry.trace import TracerProvider
    from sentry_sdk.integrations import Integration

Clock = Callable[[], datetime]


def system_clock() -> datetime:
    """The current time, timezone-aware in UTC."""
    return datetime.now(UTC)


# A delivery's limit as its runner hands it down (``time_limit`` with the seconds and the name
# bound): the deliverer puts it around the handlers or the publish only, not around the commit
# that stamps the row and delivers what the handlers raised (each of those has its own).
TimeLimit = Callable[[], AbstractAsyncContextManager[None]]


class TimeLimitExceededError(TimeoutError):
    """The work ran past its time limit and was cancelled."""


@asynccontextmanager
async def time_limit(seconds: float, what: str) -> AsyncIterator[None]:
    """Cancel the block after ``seconds`` and raise :class:`TimeLimitExceededError` naming
    ``what``; a ``TimeoutError`` the block raised itself (a publish timeout) passes unchanged."""
    limit = asyncio.timeout(seconds)
    try:
        async with limit:
            yield
    except TimeoutError as error:
        if not limit.expired():
            raise
        msg = f"{what} timed out after {seconds:g} s"
        raise TimeLimitExceededError(msg) from error


AttributeValue = str | int | float | bool


class SpanKind(enum.Enum):
    SERVER = "server"
    PRODUCER = "producer"
    CONSUMER = "consumer"
    INTERNAL = "internal"


class Span(Protocol):
    """What a caller may do with an open span."""

    @property
    def traceparent(self) -> str | None:
        """The W3C ``traceparent`` of this span: what the next hop carries."""
        ...

    def set_attribute(self, key: str, value: AttributeValue) -> None:
        """Add one attribute (``outbox.outcome``, ``messaging.message.id``...)."""
        ...

    def record_failure(self, error: BaseException) -> None:
        """Mark the span failed, with the exception as an event."""
        ...


class Tracing(Protocol):
    """Port: opens a span that continues ``traceparent`` (or starts a trace without one)."""

    def span(
        self,
        name: str,
        *,
        kind: SpanKind,
        traceparent: str | None,
        attributes: Mapping[str, AttributeValue] | None = None,
    ) -> contextlib.AbstractContextManager[Span]:
        """A context manager around one unit of work; an exception escaping it fails the span."""
        ...

    def active_traceparent(self) -> str | None:
        """The ``traceparent`` of the span an instrumentation opened around the current work (the
        HTTP server span), or ``None`` when no span is open or tracing is off."""
        ...

    @property
    def tracer_provider(self) -> TracerProvider | None:
        """The OpenTelemetry ``TracerProvider`` the instrumentations (HTTP, FastStream) report
        into, so every span of the service goes to one exporter; ``None`` when tracing is off."""
        ...

    def shutdown(self) -> None:
        """Flush what is buffered (called once when the container closes)."""
        ...

    def trace_statements(self, engine: object) -> None:
        """Open a client span per SQL statement ``engine`` (a SQLAlchemy ``Engine``) runs inside
        another span (a request, a delivery, a consumed message); statements outside any span
        (the relay's polling, the probes) open none."""
        ...


class _PassThroughSpan:
    def __init__(self, traceparent: str | None) -> None:
        self._traceparent = traceparent

    @property
    def traceparent(self) -> str | None:
        return self._traceparent

    def set_attribute(self, key: str, value: AttributeValue) -> None:
        del key, value

    def record_failure(self, error: BaseException) -> None:
        del error


class NoTracing:
    """The default: no spans, the incoming ``traceparent`` travels on unchanged."""

    @contextlib.contextmanager
    def span(
        self,
        name: str,
        *,
        kind: SpanKind,
        traceparent: str | None,
        attributes: Mapping[str, AttributeValue] | None = None,
    ) -> Iterator[Span]:
        del name, kind, attributes
        yield _PassThroughSpan(traceparent)

    def active_traceparent(self) -> str | None:
        return None

    @property
    def tracer_provider(self) -> TracerProvider | None:
        return None

    def shutdown(self) -> None:
        return None

    def trace_statements(self, engine: object) -> None:
        del engine


LAG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)
SOURCE, CONSUMER = ("source",), ("consumer",)
# attribute -> (type, name, help, labels, extra arguments)
DEFINITIONS: dict[str, tuple[type[Any], str, str, tuple[str, ...], dict[str, Any]]] = {
    "pending_depth": (
        Gauge,
        "outbox_pending_depth",
        "Rows neither processed nor dead-lettered (leased included)",
        SOURCE,
        {},
    ),
    "oldest_pending_age": (
        Gauge,
        "outbox_oldest_pending_age_seconds",
        "Age of the oldest claimable row at the last poll (0 when none)",
        SOURCE,
        {},
    ),
    "dispatch_lag": (
        Histogram,
        "outbox_dispatch_lag_seconds",
        "From occurred_on to delivered",
        SOURCE,
        {"buckets": LAG_BUCKETS},
    ),
    "dispatched": (Counter, "outbox_dispatched_total", "Rows delivered", ("source", "kind"), {}),
    "failures": (Counter, "outbox_failures_total", "Failed delivery attempts", SOURCE, {}),
    "dead_letters": (Counter, "outbox_dead_letters_total", "Rows dead-lettered", ("source", "reason"), {}),
    "unrouted": (
        Counter,
        "outbox_unrouted_total",
        "Rows published with no consumer bound (delivered to nobody, stamped processed)",
        ("source", "event_name"),
        {},
    ),
    "lost_leases": (Counter, "outbox_lost_leases_total", "Rows another processor took over", SOURCE, {}),
    "heartbeat": (
        Gauge,
        "outbox_processor_heartbeat_timestamp_seconds",
        "Unix time of the last finished cycle",
        SOURCE,
        {},
    ),
    "cleaned": (
        Counter,
        "outbox_cleanup_deleted_total",
        "Rows removed by retention",
        ("source", "state"),
        {},
    ),
    "inbox_consumed": (Counter, "inbox_consumed_total", "Messages handled and committed", CONSUMER, {}),
    "inbox_duplicates": (
        Counter,
        "inbox_duplicates_total",
        "Messages skipped as already consumed",
        CONSUMER,
        {},
    ),
    "inbox_failures": (
        Counter,
        "inbox_failures_total",
        "Handler failures (message redelivered)",
        CONSUMER,
        {},
    ),
    "inbox_outage_holds": (
        Counter,
        "inbox_database_outage_holds_total",
        "Consumed messages held and run again because the database was unreachable",
        CONSUMER,
        {},
    ),
    "inbox_dead_letters": (
        Counter,
        "inbox_dead_letters_total",
        "Consumed messages moved to the consumer's dead-letter destination",
        ("consumer", "reason"),
        {},
    ),
    "inbox_rejected": (
        Counter,
        "inbox_rejected_total",
        "Messages dead-lettered without processing (bad signature, malformed, unknown)",
        ("consumer", "reason"),
        {},
    ),
}


class RelayMetrics:
    """Every metric of the messaging machinery, labelled by ``source`` or ``consumer``."""

    pending_depth: Gauge
    oldest_pending_age: Gauge
    dispatch_lag: Histogram
    dispatched: Counter
    failures: Counter
    dead_letters: Counter
    unrouted: Counter
    lost_leases: Counter
    heartbeat: Gauge
    cleaned: Counter
    inbox_consumed: Counter
    inbox_duplicates: Counter
    inbox_failures: Counter
    inbox_outage_holds: Counter
    inbox_dead_letters: Counter
    inbox_rejected: Counter

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        for attribute, (kind, name, documentation, labels, extra) in DEFINITIONS.items():
            setattr(self, attribute, kind(name, documentation, labels, registry=self.registry, **extra))

    # -- RelayMetrics ----------------------------------------------------------------------

    def backlog_age(self, source: str, seconds: float) -> None:
        self.oldest_pending_age.labels(source).set(seconds)

    def delivered(self, source: str, kind: str, lag_seconds: float) -> None:
        self.dispatch_lag.labels(source).observe(lag_seconds)
        self.dispatched.labels(source, kind).inc()

    def failed(self, source: str) -> None:
        self.failures.labels(source).inc()

    def dead_lettered(self, source: str, reason: str, count: int = 1) -> None:
        self.dead_letters.labels(source, reason).inc(count)

    def unrouted_publish(self, source: str, event_name: str) -> None:
        self.unrouted.labels(source, event_name).inc()

    def lost_lease(self, source: str) -> None:
        self.lost_leases.labels(source).inc()

    def beat(self, source: str, now: datetime) -> None:
        self.heartbeat.labels(source).set(now.timestamp())


# -- log formats ---------------------------------------------------------------------------------


def _exception_text(formatter: logging.Formatter, record: logging.LogRecord) -> str | None:
    """The record's traceback, formatted once and cached on the record as ``logging`` does, so
    what a filter made of it (credentials masked) is what gets written."""
    if record.exc_info and not record.exc_text:
        record.exc_text = formatter.formatException(record.exc_info)
    return record.exc_text or None


class ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        context = current_context()
        record.correlation_id = context.correlation_id
        record.tenant_id = context.tenant_id or "-"
        record.trace_id, record.span_id = _active_span_ids()
        return True


def _active_span_ids() -> tuple[str | None, str | None]:
    """The trace and span ids of the OpenTelemetry span open where the record was made, so a log
    line leads to its trace. Read only when OpenTelemetry is loaded (tracing on); a record made
    outside any span has none."""
    trace = sys.modules.get("opentelemetry.trace")
    if trace is None:
        return None, None
    span = trace.get_current_span().get_span_context()
    if not span.is_valid:
        return None, None
    return f"{span.trace_id:032x}", f"{span.span_id:016x}"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "correlation_id": getattr(record, "correlation_id", None),
            "tenant_id": getattr(record, "tenant_id", None),
        }
        if trace_id := getattr(record, "trace_id", None):
            entry["trace_id"], entry["span_id"] = trace_id, getattr(record, "span_id", None)
        if exception := _exception_text(self, record):
            entry["exception"] = exception
        return json.dumps(entry)


TEXT_FORMAT = "%(asctime)s %(levelname)-7s %(name)s [%(correlation_id)s] %(message)s"

CONTINUATION = "    "  # a traceback line never starts like a record (records start with the time)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        record.message = record.getMessage()
        record.asctime = self.formatTime(record, self.datefmt)
        details = []
        if exception := _exception_text(self, record):
            details.append(exception)
        if record.stack_info:
            details.append(self.formatStack(record.stack_info))
        continued = [CONTINUATION + escape_controls(line) for text in details for line in text.splitlines()]
        return "\n".join([escape_controls(self.formatMessage(record)), *continued])


# -- otel --------------------------------------------------------------------------------------------
# OpenTelemetry tracing (TELEMETRY__TRACING=otel, extra [otel]): spans exported over OTLP, each
# continuing the traceparent the row or message carries, imported only when chosen.
#
# A span opened while an instrumentation's span of the same trace is current (FastStream's
# ``process`` span around a consumed message) is its child; otherwise its parent is the
# ``traceparent`` it is given: a delivery runs in the processor's task, where the current span
# belongs to nothing it delivers.


class _OpenTelemetrySpan:
    def __init__(self, span: Any, propagator: Any) -> None:  # noqa: ANN401 (optional dependency)
        self._span = span
        self._propagator = propagator

    @property
    def traceparent(self) -> str | None:
        from opentelemetry import trace  # noqa: PLC0415 (optional dependency)

        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=trace.set_span_in_context(self._span))
        return carrier.get("traceparent")

    def set_attribute(self, key: str, value: AttributeValue) -> None:
        self._span.set_attribute(key, value)

    def record_failure(self, error: BaseException) -> None:
        from opentelemetry.trace import Status, StatusCode  # noqa: PLC0415 (optional dependency)

        self._span.record_exception(error)
        self._span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))


class OpenTelemetryTracing:
    """Spans through the OpenTelemetry SDK, exported by ``processor`` (OTLP by default)."""

    def __init__(self, *, service_name: str, processor: SpanProcessor | None = None) -> None:
        try:
            from opentelemetry.sdk.resources import Resource  # noqa: PLC0415 (optional dependency)
            from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415
            from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased  # noqa: PLC0415
            from opentelemetry.trace.propagation.tracecontext import (  # noqa: PLC0415
                TraceContextTextMapPropagator,
            )
        except ImportError as missing:
            msg = "TELEMETRY__TRACING=otel needs the otel extra: pip install '.[otel]'"
            raise RuntimeError(msg) from missing
        if processor is None:
            processor = otlp_processor()
        resource = Resource.create({"service.name": service_name})
        self._provider = TracerProvider(resource=resource)
        self._provider.add_span_processor(processor)
        # Statements are traced only inside another span: a provider whose root spans are never
        # sampled, exporting through the same processor.
        self._statements_provider = TracerProvider(resource=resource, sampler=ParentBased(ALWAYS_OFF))
        self._statements_provider.add_span_processor(processor)
        self._statements_traced = False
        self._tracer = self._provider.get_tracer(__name__)
        self._propagator = TraceContextTextMapPropagator()

    @contextlib.contextmanager
    def span(
        self,
        name: str,
        *,
        kind: SpanKind,
        traceparent: str | None,
        attributes: Mapping[str, AttributeValue] | None = None,
    ) -> Iterator[Span]:
        from opentelemetry import trace  # noqa: PLC0415 (optional dependency)

        parent = self._parent(traceparent)
        with self._tracer.start_as_current_span(
            name,
            context=parent,
            kind=getattr(trace.SpanKind, kind.name),
            attributes=dict(attributes or {}),
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            wrapped = _OpenTelemetrySpan(span, self._propagator)
            try:
                yield wrapped
            except BaseException as error:
                wrapped.record_failure(error)
                raise

    def _parent(self, traceparent: str | None) -> Any:  # noqa: ANN401 (an OpenTelemetry Context)
        from opentelemetry import trace  # noqa: PLC0415 (optional dependency)

        extracted = self._propagator.extract({"traceparent": traceparent}) if traceparent else None
        current = trace.get_current_span().get_span_context()
        if not current.is_valid:
            return extracted
        wanted = trace.get_current_span(extracted).get_span_context() if extracted else None
        if wanted is None or wanted.trace_id == current.trace_id:
            return None  # the current context: the instrumentation's span of this same trace
        return extracted

    def active_traceparent(self) -> str | None:
        from opentelemetry import trace  # noqa: PLC0415 (optional dependency)

        span = trace.get_current_span()
        if not span.get_span_context().is_valid:
            return None
        return _OpenTelemetrySpan(span, self._propagator).traceparent

    @property
    def tracer_provider(self) -> TracerProvider | None:
        return self._provider

    def shutdown(self) -> None:
        if self._statements_traced:
            from opentelemetry.instrumentation.sqlalchemy import SQLAlchemyInstrumentor  # noqa: PLC0415

            SQLAlchemyInstrumentor().uninstrument()
        self._provider.shutdown()  # the processor the statements' provider shares, too

    def trace_statements(self, engine: object) -> None:
        try:
            from opentelemetry.instrumentation.sqlalchemy import SQLAlchemyInstrumentor  # noqa: PLC0415
        except ImportError as missing:
            msg = "TELEMETRY__TRACING=otel needs the SQLAlchemy instrumentation: pip install '.[otel]'"
            raise RuntimeError(msg) from missing
        instrumentor = SQLAlchemyInstrumentor()  # one per process (its own rule): the last wins
        if instrumentor.is_instrumented_by_opentelemetry:
            instrumentor.uninstrument()
        # skip_dep_check: its releases still declare SQLAlchemy < 2.1; the kit's tests run it on
        # the SQLAlchemy the service installs (tests/kit/test_tracing.py).
        instrumentor.instrument(
            engine=engine,
            tracer_provider=self._statements_provider,
            enable_commenter=False,
            skip_dep_check=True,
        )
        self._statements_traced = True


def otlp_processor() -> SpanProcessor:
    """What the spans go to by default: batches sent over OTLP/HTTP, configured by OpenTelemetry's
    own variables (``OTEL_EXPORTER_OTLP_ENDPOINT``...)."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # noqa: PLC0415
            OTLPSpanExporter,
        )
        from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: PLC0415
    except ImportError as missing:
        msg = "TELEMETRY__TRACING=otel needs the OTLP exporter: pip install '.[otel]'"
        raise RuntimeError(msg) from missing
    return BatchSpanProcessor(OTLPSpanExporter())


# -- error tracking ----------------------------------------------------------------------------------
# Sentry (SENTRY__DSN, extra [sentry]): unhandled errors and ERROR log records sent as events, each
# with the caller's tenant, user and correlation id, and nothing secret. Imported only when a DSN is set.


def configure_error_tracking(
    *, dsn: str, environment: str, release: str | None, sample_rate: float, secrets: Iterable[str] = ()
) -> bool:
    """Start sending errors to Sentry when ``dsn`` is set (once per process); ``False`` when off.
    Every event and breadcrumb is scrubbed first: ``secrets`` (the process's own, by value), any
    credential by its shape, any value under a key that names a secret (:class:`Scrubber`)."""
    if not dsn:
        return False
    try:
        import sentry_sdk  # noqa: PLC0415 (optional dependency)
    except ImportError as missing:
        msg = "SENTRY__DSN needs the Sentry SDK: pip install '.[sentry]'"
        raise RuntimeError(msg) from missing
    scrubber = Scrubber(secrets)
    # The scrubbing is the kit's own, in the two hooks Sentry 2 and 3 both have (Sentry 3 has no
    # sentry_sdk.scrubber). Sentry's Event and Breadcrumb are TypedDicts of their own: cast.
    sentry_sdk.init(
        dsn=dsn,
        environment=environment,
        release=release or None,
        sample_rate=sample_rate,
        traces_sample_rate=None,  # traces are OpenTelemetry's (TELEMETRY__TRACING)
        before_send=cast("Any", partial(_reported, scrubber)),
        before_breadcrumb=cast("Any", scrubber.event),
        before_send_log=cast("Any", scrubber.event),  # none are sent (below); scrubbed if ever
        integrations=[_log_records_as_events()],
    )
    return True


def _log_records_as_events() -> Integration:
    """ERROR records become events and INFO ones their breadcrumbs, on Sentry 2 and 3: Sentry 3
    no longer enables this by default, and its ``level`` sends every record as a Sentry Log (past
    ``before_send``) where Sentry 2's meant breadcrumbs."""
    from sentry_sdk.integrations.logging import LoggingIntegration  # noqa: PLC0415

    if "breadcrumb_level" in inspect.signature(LoggingIntegration).parameters:  # Sentry 3
        return LoggingIntegration(level=None, event_level=logging.ERROR)
    return LoggingIntegration(level=logging.INFO, event_level=logging.ERROR)


def _reported(scrubber: Scrubber, event: dict[str, Any], hint: dict[str, Any]) -> dict[str, Any]:
    """What is sent of ``event``: with the caller's context, then scrubbed (the tags too)."""
    return scrubber.event(with_request_context(event, hint))


def with_request_context(event: dict[str, Any], hint: dict[str, Any]) -> dict[str, Any]:
    """The caller's tenant, user and correlation id on the event (the context of the request or
    of the message being handled when it happened)."""
    del hint
    context = current_context()
    tags = event.setdefault("tags", {})  # a request's own, set by tag_error_reports, come first
    tags.setdefault("correlation_id", context.correlation_id)
    if context.tenant_id:
        tags.setdefault("tenant_id", context.tenant_id)
    if context.user_id and not event.get("user"):
        event["user"] = {"id": context.user_id}
    return event


def tag_error_reports(context: RequestContext) -> None:
    """Put the caller on the error-tracking scope of the current request: Sentry's ASGI
    integration reports an unhandled error after the request context has ended."""
    sentry_sdk = sys.modules.get("sentry_sdk")
    if sentry_sdk is None or not sentry_sdk.get_client().is_active():
        return
    scope = sentry_sdk.get_isolation_scope()
    scope.set_tag("correlation_id", context.correlation_id)
    if context.tenant_id:
        scope.set_tag("tenant_id", context.tenant_id)
    if context.user_id:
        scope.set_user({"id": context.user_id})
