"""The service's edges: the message bus and its signer, bearer tokens, tracing, HTTP metrics."""

from __future__ import annotations

import os
from datetime import timedelta

from outbox_kit.application.handlers import HandlerRegistry
from outbox_kit.application.messages import MessageRegistry
from outbox_kit.application.observability import NoTracing, RelayMetrics, Tracing, system_clock
from outbox_kit.application.otel import OpenTelemetryTracing
from outbox_kit.consume.bus import InProcessBus
from outbox_kit.consume.inbox import ConsumePipeline
from outbox_kit.runtime.http import TokenService
from outbox_kit.transports.bus import MessageBus
from outbox_kit.transports.envelope import Signer
from prometheus_fastapi_instrumentator import Instrumentator
from prometheus_fastapi_instrumentator import metrics as http_metrics

from ..about import SERVICE_SLUG
from ..settings import Settings, TracingBackend


def build_signer(settings: Settings) -> Signer:
    bus = settings.message_bus
    keys = {kid: secret.get_secret_value() for kid, secret in bus.signing_keys.items()}
    return Signer(keys, bus.active_key_id, allow_unsigned=bus.allow_unsigned or not keys)


def build_bus(  # noqa: PLR0917 (the container passes providers positionally)
    settings: Settings,
    handlers: HandlerRegistry,
    registry: MessageRegistry,
    pipeline: ConsumePipeline,
    signer: Signer,
    metrics: RelayMetrics,
    tracing: Tracing,
) -> MessageBus:
    if not settings.message_bus.is_broker:
        return InProcessBus(
            handlers=handlers,
            registry=registry,
            pipeline=pipeline,
            signer=signer,
            handler_timeout_seconds=settings.message_bus.handler_timeout_seconds,
        )
    from outbox_kit.consume.bus import FastStreamBus  # noqa: PLC0415

    return FastStreamBus(
        settings=settings.message_bus,
        namespace=settings.application.resolved_namespace,
        handlers=handlers,
        registry=registry,
        pipeline=pipeline,
        signer=signer,
        metrics=metrics,
        tracer_provider=tracing.tracer_provider,
    )


def build_tracing(settings: Settings) -> Tracing:
    if settings.telemetry.tracing is TracingBackend.OTEL:
        return OpenTelemetryTracing(service_name=os.environ.get("OTEL_SERVICE_NAME") or SERVICE_SLUG)
    return NoTracing()


def build_tokens(settings: Settings) -> TokenService:
    auth = settings.auth
    return TokenService(
        secret=auth.jwt_secret.get_secret_value(),
        algorithm=auth.jwt_algorithm,
        issuer=auth.jwt_issuer,
        audience=auth.jwt_audience,
        ttl=timedelta(minutes=auth.token_ttl_minutes),
        clock=system_clock,
    )


# The probes and the scrape would dominate the HTTP figures; they are watched by other means.
UNMEASURED_ROUTES = ["/metrics", "/livez", "/readyz"]


def build_http_metrics(metrics: RelayMetrics) -> Instrumentator:
    """HTTP metrics per route (``http_requests_total`` by handler, method and status, durations,
    sizes) from prometheus-fastapi-instrumentator, in the service's registry.

    Its metrics are made here, once per container: an app built twice on one container (tests
    do) shares them instead of registering them twice."""
    instrumentator = Instrumentator(
        registry=metrics.registry,
        should_group_status_codes=False,  # a 401 and a 409 mean different things
        excluded_handlers=UNMEASURED_ROUTES,
    )
    return instrumentator.add(http_metrics.default(registry=metrics.registry))
