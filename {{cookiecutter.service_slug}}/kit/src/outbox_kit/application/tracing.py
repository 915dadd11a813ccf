"""Tracing: one span around each unit of delivery work, OpenTelemetry when switched on.

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
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor
    from opentelemetry.trace import TracerProvider


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
