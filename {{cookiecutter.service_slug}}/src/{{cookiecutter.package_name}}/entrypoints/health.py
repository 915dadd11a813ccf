"""The probe routes every serving process has: liveness, readiness (the database and the bus
answer) and metrics in the Prometheus text format; and the AsyncAPI document, on the API only.

Liveness and readiness answer different questions. ``/readyz`` fails while a dependency is
down or does not answer within ``API__READINESS_TIMEOUT_SECONDS`` (the checks run at once):
route no traffic here, but do not restart (a restart would not bring the database back).
``/livez`` fails only when this process is stuck: a processor loop that stopped turning (see
``Worker.stalled``); then a restart is the cure. The API alone has no loop, so its ``/livez``
only proves the event loop answers.
"""

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from outbox_kit.application.text import mask_credentials
from outbox_kit.runtime.worker import Worker
from outbox_kit.transports.asyncapi import asyncapi_document
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..about import DESCRIPTION, SERVICE_NAME
from ..container import Container

PROMETHEUS_TEXT: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The metrics in the Prometheus text format",
        "content": {"text/plain": {"schema": {"type": "string"}}},
    }
}


def add_probe_routes(app: FastAPI, container: Container, *, worker: Worker | None) -> None:
    """``/livez`` (the worker's loops turn, when this process runs one), ``/readyz``, ``/metrics``."""

    @app.get("/livez", tags=["health"], responses={503: {"description": "A processor loop is stalled"}})
    async def livez() -> JSONResponse:
        stalled = worker.stalled() if worker is not None else []
        if stalled:
            return JSONResponse({"status": "stalled", "stalled": stalled}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/readyz", tags=["health"], responses={503: {"description": "The database or broker is down"}})
    async def readyz() -> JSONResponse:
        probes = {"database": container.database().ping, "bus": container.bus().ping}
        timeout = container.settings().api.readiness_timeout_seconds
        results = await asyncio.gather(*(_check(probe, timeout) for probe in probes.values()))
        checks = dict(zip(probes, results, strict=True))
        ready = all(value == "ok" for value in checks.values())
        return JSONResponse(
            {"status": "ok" if ready else "unavailable", "checks": checks}, status_code=200 if ready else 503
        )

    @app.get("/metrics", tags=["health"], response_class=PlainTextResponse, responses=PROMETHEUS_TEXT)
    async def metrics() -> Response:
        return Response(generate_latest(container.metrics().registry), media_type=CONTENT_TYPE_LATEST)


async def _check(probe: Callable[[], Awaitable[None]], within_seconds: float) -> str:
    """``ok`` or why not. Bounded (``API__READINESS_TIMEOUT_SECONDS``): a dependency whose line
    went silent must fail the probe, not hang it (and pile up one stuck probe per period)."""
    try:
        async with asyncio.timeout(within_seconds):
            await probe()
    except TimeoutError:
        return f"error: no answer within {within_seconds:g} s"
    except Exception as error:  # noqa: BLE001 (reported, not raised)
        return f"error: {type(error).__name__}: {mask_credentials(str(error))}"
    return "ok"


def service_asyncapi(container: Container) -> dict[str, Any]:
    """This service's AsyncAPI document (``GET /asyncapi`` and ``python -m <package> asyncapi``)."""
    settings = container.settings()
    return asyncapi_document(
        container.registry(),
        container.handlers(),
        settings.message_bus,
        namespace=settings.application.namespace,
        title=SERVICE_NAME,
        description=DESCRIPTION,
    )


def add_asyncapi_route(app: FastAPI, container: Container) -> None:
    @app.get("/asyncapi", tags=["messaging"])
    async def asyncapi() -> dict[str, Any]:
        return service_asyncapi(container)
