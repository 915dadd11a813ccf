"""The FastAPI application factory.

The lifespan validates the wiring (start-up diagnostics), connects the message bus, and, when
asked (``run``), starts the worker in the same process. Tests use a real ASGI server or
``TestClient`` as a context manager, which run the lifespan (httpx's ASGITransport does not).
"""

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..about import DESCRIPTION, SERVICE_NAME
from ..building_blocks.brokers.asyncapi import asyncapi_document
from ..building_blocks.kernel.redaction import mask_credentials
from ..building_blocks.web.edge import RequestEdgeMiddleware
from ..building_blocks.web.errors import install_error_handlers
from ..building_blocks.web.http import RequestContextMiddleware
from ..container import Container, startup_diagnostics
from .admin_api import build_admin_router


def create_app(container: Container, *, with_worker: bool = False) -> FastAPI:
    """Build the HTTP app; ``with_worker`` also runs processors and consumers in-process."""
    settings = container.settings()

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        startup_diagnostics(container)
        bus = container.bus()
        await bus.start()
        worker = container.worker() if with_worker else None
        if worker is not None:
            await worker.start()
        try:
            yield
        finally:
            if worker is not None:
                await worker.stop()  # stops the bus too
            else:
                await bus.stop()
            await container.database().dispose()
            container.tracing().shutdown()

    app = FastAPI(title=SERVICE_NAME, description=DESCRIPTION, lifespan=lifespan)
    app.state.container = container
    app.state.units_of_work = container.units_of_work()
    app.state.outbox_admin = container.admin()
    # Added first, so it runs inside the context middleware: its 413/422 carry the correlation id.
    app.add_middleware(RequestEdgeMiddleware, max_body_bytes=settings.api.max_body_bytes)
    app.add_middleware(RequestContextMiddleware, tokens=container.tokens(), tracing=container.tracing())
    install_error_handlers(app)

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

    app.include_router(build_admin_router(settings.auth.admin_role, settings.auth.operator_role))
    for module in container.modules():
        for router in module.routers:
            app.include_router(router)
    return app
