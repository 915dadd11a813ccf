"""No tracing (the default): nothing imported, nothing recorded, and the caller's traceparent
passed on untouched, so a trace that started upstream still runs through this service's rows and
messages."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from .tracing import AttributeValue, Span, SpanKind

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider


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
