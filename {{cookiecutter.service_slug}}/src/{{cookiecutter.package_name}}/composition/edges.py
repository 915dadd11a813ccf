"""The service's edges: the message bus and its signer, bearer tokens, tracing, HTTP metrics."""

from __future__ import annotations

import os
from datetime import timedelta

from prometheus_fastapi_instrumentator import Instrumentator
from prometheus_fastapi_instrumentator import metrics as http_metrics

from ..about import SERVICE_SLUG
from ..building_blocks.application.handlers import HandlerRegistry
from ..building_blocks.application.registry import MessageRegistry
from ..building_blocks.brokers.in_process import InProcessBus
from ..building_blocks.inbox.pipeline import ConsumePipeline
from ..building_blocks.kernel.clock import system_clock
from ..building_blocks.kernel.metrics import RelayMetrics
from ..building_blocks.kernel.no_tracing import NoTracing
from ..building_blocks.kernel.otel import OpenTelemetryTracing
from ..building_blocks.kernel.tracing import Tracing
from ..building_blocks.messaging.bus import MessageBus
from ..building_blocks.messaging.signing import Signer
from ..building_blocks.web.auth import TokenService
from ..settings import Settings
from ..settings import Tracing as TracingChoice


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
    from ..building_blocks.brokers.faststream_bus import FastStreamBus  # noqa: PLC0415

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
    if settings.telemetry.tracing is TracingChoice.OTEL:
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
