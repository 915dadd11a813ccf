"""The service's own routes: liveness, readiness (the database and the bus answer), metrics in the
Prometheus text format, and the AsyncAPI document of its messages."""

from typing import Any

from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..building_blocks.brokers.asyncapi import asyncapi_document
from ..building_blocks.kernel.redaction import mask_credentials
from ..container import Container


def add_health_routes(app: FastAPI, container: Container) -> None:
    settings = container.settings()

    @app.get("/livez", tags=["health"])
    async def livez() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"])
    async def readyz() -> JSONResponse:
        checks: dict[str, str] = {}
        for name, probe in (("database", container.database().ping), ("bus", container.bus().ping)):
            try:
                await probe()
                checks[name] = "ok"
            except Exception as error:  # noqa: BLE001 (reported, not raised)
                checks[name] = f"error: {type(error).__name__}: {mask_credentials(str(error))}"
        ready = all(value == "ok" for value in checks.values())
        return JSONResponse(
            {"status": "ok" if ready else "unavailable", "checks": checks}, status_code=200 if ready else 503
        )

    @app.get("/metrics", tags=["health"])
    async def metrics() -> Response:
        return Response(generate_latest(container.metrics().registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/asyncapi", tags=["messaging"])
    async def asyncapi() -> dict[str, Any]:
        return asyncapi_document(container.registry(), container.handlers(), settings)
