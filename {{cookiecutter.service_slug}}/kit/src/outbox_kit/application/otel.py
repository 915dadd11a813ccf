"""OpenTelemetry tracing (TELEMETRY__TRACING=otel, extra [otel]): spans exported over OTLP, each
continuing the traceparent the row or message carries, imported only when chosen.

A span opened while an instrumentation's span of the same trace is current (FastStream's
``process`` span around a consumed message) is its child; otherwise its parent is the
``traceparent`` it is given: a delivery runs in the processor's task, where the current span
belongs to nothing it delivers."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from outbox_kit.application.observability import AttributeValue, Span, SpanKind

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor
    from opentelemetry.trace import TracerProvider


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
            from opentelemetry.trace.propagation.tracecontext import (  # noqa: PLC0415
                TraceContextTextMapPropagator,
            )
        except ImportError as missing:
            msg = "TELEMETRY__TRACING=otel needs the otel extra: pip install '.[otel]'"
            raise RuntimeError(msg) from missing
        if processor is None:
            processor = otlp_processor()
        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self._provider.add_span_processor(processor)
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
        self._provider.shutdown()


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
