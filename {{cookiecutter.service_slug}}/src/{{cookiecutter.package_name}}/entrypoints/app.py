"""The FastAPI application factory.

The lifespan validates the wiring (start-up diagnostics), connects the message bus, and, when
asked (``run``), starts the worker in the same process. ``create_worker_app`` is what
``worker --port`` serves: the worker and its probes, no API. Tests use a real ASGI server or
``TestClient`` as a context manager, which run the lifespan (httpx's ASGITransport does not).
"""

from fastapi import FastAPI
from outbox_kit.runtime.admin_api import build_admin_router
from outbox_kit.runtime.errors import error_responses, install_error_handlers
from outbox_kit.runtime.http import RequestContextMiddleware, RequestEdgeMiddleware, trace_requests

from ..about import DESCRIPTION, SERVICE_NAME
from ..container import Container
from .health import add_asyncapi_route, add_probe_routes
from .lifespan import lifespan


def create_app(container: Container, *, with_worker: bool = False) -> FastAPI:
    """Build the HTTP app; ``with_worker`` also runs processors and consumers in-process."""
    settings = container.settings()

    app = FastAPI(
        title=SERVICE_NAME,
        description=DESCRIPTION,
        lifespan=lifespan(container, with_worker=with_worker),
        # What the edge answers for any operation: a refused header, a body too slow or too
        # large, text no database stores or a non-finite number, a database that did not answer
        # in time (see outbox_kit.runtime.http).
        responses=error_responses(400, 408, 413, 422, 503),
    )
    app.state.container = container
    app.state.units_of_work = container.units_of_work()
    app.state.outbox_admin = container.admin()
    # Added first, so it runs inside the context middleware: its 413/422 carry the correlation id.
    app.add_middleware(
        RequestEdgeMiddleware,
        max_body_bytes=settings.api.max_body_bytes,
        body_read_timeout_seconds=settings.api.body_read_timeout_seconds,
    )
    app.add_middleware(RequestContextMiddleware, tokens=container.tokens(), tracing=container.tracing())
    install_error_handlers(app)
    container.http_metrics().instrument(app)
    trace_requests(app, container.tracing())  # last: its server span is around everything above

    add_probe_routes(app, container, worker=container.worker() if with_worker else None)
    add_asyncapi_route(app, container)
    app.include_router(build_admin_router(settings.auth.admin_role, settings.auth.operator_role))
    for module in container.modules():
        for router in module.routers:
            app.include_router(router)
    return app


def create_worker_app(container: Container) -> FastAPI:
    """The worker with ``/livez``, ``/readyz`` and ``/metrics`` only (no API, no documents)."""
    app = FastAPI(
        title=f"{SERVICE_NAME} worker",
        lifespan=lifespan(container, with_worker=True),
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    add_probe_routes(app, container, worker=container.worker())
    return app
