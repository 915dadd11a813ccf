"""HTTP server spans from the maintained OpenTelemetry FastAPI instrumentation (tracing on only).

It names each span after the route template (``GET /orders/{order_id}``), records the HTTP
semantic-convention attributes and continues the caller's ``traceparent``; the service's
request context then reads that span's ``traceparent`` for the outbox rows the request writes.
The probes and ``/metrics`` get no span: an orchestrator polling them would bury the requests.
The per-message ``receive``/``send`` sub-spans are left out for the same reason.
"""

from __future__ import annotations

from fastapi import FastAPI

from ..kernel.tracing import Tracing

UNTRACED_PATHS = ("/livez", "/readyz", "/metrics")


def trace_requests(app: FastAPI, tracing: Tracing) -> None:
    """Open a server span around every request of ``app`` when tracing is on."""
    if tracing.tracer_provider is None:
        return
    try:
        from opentelemetry.instrumentation.fastapi import (  # noqa: PLC0415 (optional dependency)
            FastAPIInstrumentor,
        )
    except ImportError as missing:
        msg = "TELEMETRY__TRACING=otel needs the FastAPI instrumentation: pip install '.[otel]'"
        raise RuntimeError(msg) from missing
    FastAPIInstrumentor.instrument_app(
        app,
        tracer_provider=tracing.tracer_provider,
        # matched against the whole URL (scheme, host and path, no query)
        excluded_urls=",".join(f"://[^/]+{path}$" for path in UNTRACED_PATHS),
        exclude_spans=["receive", "send"],
    )
