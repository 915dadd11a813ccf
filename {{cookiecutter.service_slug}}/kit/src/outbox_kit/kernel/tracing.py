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
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
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
