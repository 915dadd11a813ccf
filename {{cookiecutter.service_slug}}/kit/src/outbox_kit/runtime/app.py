"""The HTTP apps of a service and what they do when they start and stop.

``create_app`` is the API (``run`` also starts the worker in-process): the request edge, the
caller's context, errors, metrics and traces, the probes, the AsyncAPI document, the admin API
under ``/admin/outbox`` and every context's routers. ``create_worker_app`` is what ``worker
--port`` serves: the worker and its probes, no API. Tests use a real ASGI server or
``TestClient`` as a context manager, which run the lifespan (httpx's ASGITransport does not).

Probes. Liveness and readiness answer different questions. ``/readyz`` fails while a dependency
is down or does not answer within ``API__READINESS_TIMEOUT_SECONDS`` (the checks run at once):
route no traffic here, but do not restart (a restart would not bring the database back).
``/livez`` fails only when this process is stuck: a processor loop that stopped turning (see
``Worker.stalled``); then a restart is the cure. The API alone has no loop, so its ``/livez``
only proves the event loop answers.

A partial outage stays partial. Readiness is decided by the default source's database and the
bus: a context in a source of its own that is down is reported (``database:<source>``, status
``degraded``) but does not take every replica out of the load balancer (that context's routes
answer 503 naming it, see ``outbox_kit.runtime.errors``). ``/readyz?source=<name>`` decides by
that source's database and the bus instead, ``/readyz?source=all`` by every source: the probes
for a monitor or for a load balancer in front of one context's routes.

AsyncAPI. ``GET /asyncapi`` and the ``asyncapi`` command serve the AsyncAPI 3.0 document of the
service, built from the registered messages: every integration event gets a channel (its broker
address) and a message schema (from its pydantic model); every consumer gets a receive operation.
A test fails when an integration event has no channel, so the document cannot drift from the
code. The document is public (it needs no token), so its server entry names the broker's hosts
and path only: user, password and query string (``?password=``, TLS file paths) of
``MESSAGE_BUS__URL`` never leave the process.

Admin API. Two roles: ``outbox-admin`` (``AUTH__ADMIN_ROLE``) works within the token's tenant,
so another tenant's row answers 404 exactly like a row that does not exist; the operator role
(``AUTH__OPERATOR_ROLE``, ``outbox-operator``) sees and replays every tenant's rows, rows without
a tenant included. A replay is recorded with the caller's identity (the token's subject), never a
name the request body could choose. An unknown id is 404, any other request an operator can fix
is 400. A source or id that is not one by its shape (not a known table, not a UUID) is refused
by the schema itself (422), as the OpenAPI document says.

Stopping, bounded by a deadline: the worker (which closes the bus) or the bus, then the database
pool, then the last spans. ``OUTBOX__SHUTDOWN_TIMEOUT_SECONDS`` is the unit: the in-flight
deliveries get it (see ``Worker.stop``) and closing the connections as long again; without a
worker, closing alone. What does not finish by then (a database line gone silent, a broker that
never acknowledges the close, a trace collector that never answers) is abandoned, and the server
drops the connection when it notices. A library that ignores the cancellation cannot hold the
process either: a process of its own asks for a forced exit ``FORCED_EXIT_GRACE_SECONDS`` past
the deadline.
"""

import asyncio
import contextlib
import logging
import os
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import asdict, dataclass
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, create_model

from outbox_kit.application.context import RequestContext
from outbox_kit.application.handlers import HandlerRegistry
from outbox_kit.application.messages import IntegrationEvent, MessageRegistry
from outbox_kit.application.text import mask_credentials
from outbox_kit.application.tracing import Tracing
from outbox_kit.application.unit_of_work import UnitOfWorkFactory
from outbox_kit.operations.admin import RelayAdministration
from outbox_kit.operations.rows import (
    EVERY_TENANT,
    MAX_OFFSET,
    MAX_PAGE,
    AdminError,
    NothingToReplayError,
    RowNotFoundError,
    Targets,
    TenantScope,
)
from outbox_kit.persistence.tables import DEFAULT_SOURCE
from outbox_kit.runtime.container import OutboxContainer
from outbox_kit.runtime.diagnostics import startup_diagnostics
from outbox_kit.runtime.edge import RequestEdgeMiddleware
from outbox_kit.runtime.errors import ContextOfRoute, error_responses, install_error_handlers
from outbox_kit.runtime.heap import freeze_start_up_heap
from outbox_kit.runtime.http import (
    KEY_PATTERN,
    Bearer,
    RequestContextMiddleware,
    require_role,
    trace_requests,
)
from outbox_kit.runtime.worker import Worker
from outbox_kit.transports.envelope import CLOUD_EVENT_ATTRIBUTES, SIGNATURE, SIGNED_HEADERS
from outbox_kit.transports.settings import EndpointNames, MessageBusSettings, Transport

log = logging.getLogger(__name__)

# After the deadline: time for the event loop to unwind and the interpreter to exit normally.
FORCED_EXIT_GRACE_SECONDS = 2.0
# Set on an app's state by the process's own server (``server.serve_app``), so its lifespan
# freezes the start-up heap (``runtime.heap``) and asks for the forced exit after the stop
# deadline; an app served in a test never has it.
OWN_PROCESS_STATE = "served_by_a_process_of_its_own"


def create_app(container: OutboxContainer, *, with_worker: bool = False) -> FastAPI:
    """Build the HTTP app; ``with_worker`` also runs processors and consumers in-process."""
    settings = container.settings()

    app = FastAPI(
        title=type(settings).service_name,
        description=type(settings).description,
        lifespan=lifespan(container, with_worker=with_worker),
        # What the edge answers for any operation: a refused header, a body too slow or too
        # large, text no database stores or a non-finite number, a database that did not answer
        # in time (see outbox_kit.runtime.edge and outbox_kit.runtime.errors).
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
    admin_router = build_admin_router(
        settings.auth.admin_role, settings.auth.operator_role, container.admin().targets
    )
    app.include_router(admin_router)
    # A context's routes get the units of work of its source (``units_of_work`` looks the
    # matched endpoint up here); anything else gets the default source's.
    # The context and source are kept too: a route whose database is down answers 503 naming them.
    sources = container.data_sources()
    by_endpoint: dict[Callable[..., Any], UnitOfWorkFactory] = {}
    contexts: dict[Callable[..., Any], ContextOfRoute] = {}
    for module in container.modules():
        source = sources.of_context(module.name)
        for router in module.routers:
            app.include_router(router)
            endpoints = [route.endpoint for route in router.routes if isinstance(route, APIRoute)]
            by_endpoint |= dict.fromkeys(endpoints, source.units)
            contexts |= dict.fromkeys(endpoints, ContextOfRoute(module.name, source.name))
    app.state.units_by_endpoint = by_endpoint
    app.state.context_by_endpoint = contexts
    return app


def create_worker_app(container: OutboxContainer) -> FastAPI:
    """The worker with ``/livez``, ``/readyz`` and ``/metrics`` only (no API, no documents)."""
    app = FastAPI(
        title=f"{type(container.settings()).service_name} worker",
        lifespan=lifespan(container, with_worker=True),
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    add_probe_routes(app, container, worker=container.worker())
    return app


def lifespan(
    container: OutboxContainer, *, with_worker: bool
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app's lifespan: start-up diagnostics, the bus connected (and, for ``run``, the worker
    started), and everything stopped in order, within a deadline, on shutdown."""

    @asynccontextmanager
    async def run(app: FastAPI) -> AsyncIterator[None]:
        startup_diagnostics(container)
        bus = container.bus()
        await bus.start()
        worker = container.worker() if with_worker else None
        if worker is not None:
            await worker.start()
        own_process = bool(getattr(app.state, OWN_PROCESS_STATE, False))
        if own_process:
            freeze_start_up_heap()
        try:
            yield
        finally:
            await stop_within_deadline(container, worker, force_exit=own_process)

    return run


PROMETHEUS_TEXT: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The metrics in the Prometheus text format",
        "content": {"text/plain": {"schema": {"type": "string"}}},
    }
}


def add_probe_routes(app: FastAPI, container: OutboxContainer, *, worker: Worker | None) -> None:
    """``/livez`` (the worker's loops turn, when this process runs one), ``/readyz``, ``/metrics``."""

    @app.get("/livez", tags=["health"], responses={503: {"description": "A processor loop is stalled"}})
    async def livez() -> JSONResponse:
        stalled = worker.stalled() if worker is not None else []
        if stalled:
            return JSONResponse({"status": "stalled", "stalled": stalled}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get(
        "/readyz",
        tags=["health"],
        responses={
            503: {"description": "The database (of the source asked about) or the broker is down"},
            404: {"description": "No source of that name"},
        },
    )
    async def readyz(
        source: Annotated[
            str | None,
            Query(
                description=(
                    "Decide by this source's database (and the bus) instead of the default "
                    "source's; 'all' decides by every source"
                ),
                max_length=64,
                # Visible ASCII, as every source name is: the schema says what the probe reads
                # (a NUL was schema-valid, and refused as unstorable text).
                pattern=KEY_PATTERN,
            ),
        ] = None,
    ) -> JSONResponse:
        sources = container.data_sources()
        # One line per source: "database" is the default source's, "database:<source>" another's.
        probes = {_check_name(s.name): s.database.ping for s in sources}
        probes["bus"] = container.bus().ping
        names = [s.name for s in sources]
        deciding = _deciding_checks(source, names)
        if deciding is None:
            known = ", ".join(names)
            return JSONResponse({"detail": f"no source named {source!r}; the sources: {known}, all"}, 404)
        timeout = container.settings().api.readiness_timeout_seconds
        results = await asyncio.gather(*(_check(probe, timeout) for probe in probes.values()))
        checks = dict(zip(probes, results, strict=True))
        ready = all(checks[name] == "ok" for name in deciding)
        # "degraded": ready, but a source that does not decide it is down (reported, not failed).
        state = "ok" if all(v == "ok" for v in checks.values()) else "degraded" if ready else "unavailable"
        return JSONResponse({"status": state, "checks": checks}, status_code=200 if ready else 503)

    @app.get("/metrics", tags=["health"], response_class=PlainTextResponse, responses=PROMETHEUS_TEXT)
    async def metrics() -> Response:
        return Response(generate_latest(container.metrics().registry), media_type=CONTENT_TYPE_LATEST)


def _deciding_checks(asked: str | None, sources: Sequence[str]) -> set[str] | None:
    """The checks that decide readiness: the default source's database and the bus; those of
    the source ``asked`` instead; every one for ``all``; None when no source has that name."""
    if asked == "all":
        return {*map(_check_name, sources), "bus"}
    if asked is None or asked in sources:
        return {_check_name(asked or DEFAULT_SOURCE), "bus"}
    return None


def _check_name(source: str) -> str:
    return "database" if source == DEFAULT_SOURCE else f"database:{source}"


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


def service_asyncapi(container: OutboxContainer) -> dict[str, Any]:
    """This service's AsyncAPI document (``GET /asyncapi`` and ``python -m <package> asyncapi``)."""
    settings = container.settings()
    return asyncapi_document(
        container.registry(),
        container.handlers(),
        settings.message_bus,
        namespace=settings.application.namespace,
        title=type(settings).service_name,
        description=type(settings).description,
    )


def add_asyncapi_route(app: FastAPI, container: OutboxContainer) -> None:
    @app.get("/asyncapi", tags=["messaging"])
    async def asyncapi() -> dict[str, Any]:
        return service_asyncapi(container)


def stop_deadline_seconds(container: OutboxContainer, *, with_worker: bool) -> float:
    """How long stopping may take (see the module docstring)."""
    timeout = container.settings().outbox.shutdown_timeout_seconds
    return 2 * timeout if with_worker else timeout


async def stop_within_deadline(
    container: OutboxContainer, worker: Worker | None, *, force_exit: bool
) -> None:
    """Stop everything within ``stop_deadline_seconds``; with ``force_exit`` (a process of its
    own, never a test's server) the process exits ``FORCED_EXIT_GRACE_SECONDS`` after it even if
    something swallowed the cancellation."""
    seconds = stop_deadline_seconds(container, with_worker=worker is not None)
    if force_exit:
        watchdog = threading.Timer(seconds + FORCED_EXIT_GRACE_SECONDS, _exit_now, args=(seconds,))
        watchdog.daemon = True  # the process ending normally ends it
        watchdog.start()
    deadline = asyncio.get_running_loop().time() + seconds
    try:
        async with asyncio.timeout_at(deadline):
            if worker is not None:
                await worker.stop()  # processors first, then consumers and the bus
            else:
                await container.bus().stop()
            await container.data_sources().dispose()
    except TimeoutError:
        log.error(  # noqa: TRY400 (the deadline, not a fault: no traceback to show)
            "shutdown: not finished within %g s (twice OUTBOX__SHUTDOWN_TIMEOUT_SECONDS with a "
            "worker, once without); the connections still open are abandoned",
            seconds,
        )
    await _shut_tracing_down(container.tracing(), deadline)


def _exit_now(seconds: float) -> None:
    """The watchdog: the stop outlived its deadline (a library kept waiting through the
    cancellation). Exit status 0: the stop was asked for, and what it abandoned is only
    connections (rows are released or wait out their lease)."""
    log.error(
        "shutdown: still running %g s after the %g s deadline (something ignored the cancellation); "
        "exiting now",
        FORCED_EXIT_GRACE_SECONDS,
        seconds,
    )
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    os._exit(0)


async def _shut_tracing_down(tracing: Tracing, deadline: float) -> None:
    """The last export blocks (up to the exporter's own timeout, ``OTEL_EXPORTER_OTLP_TIMEOUT``,
    when the collector does not answer), so it runs in a daemon thread, waited for until the
    deadline (a moment at least): one still hanging then does not hold the exit, and its spans
    are dropped."""
    loop = asyncio.get_running_loop()
    finished = loop.create_future()

    def done() -> None:
        if not finished.done():
            finished.set_result(None)

    def shut_down() -> None:
        try:
            tracing.shutdown()
        except Exception:
            log.warning("shutdown: the tracing exporter failed", exc_info=True)
        finally:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                loop.call_soon_threadsafe(done)

    threading.Thread(target=shut_down, name="tracing-shutdown", daemon=True).start()
    try:
        async with asyncio.timeout(max(deadline - loop.time(), 0.1)):
            await finished
    except TimeoutError:
        log.warning("shutdown: the last spans were not exported in time (no answer from the collector)")


@dataclass(frozen=True)
class Administrator:
    """An admin API caller and the rows it may see."""

    context: RequestContext
    scope: TenantScope


def one_of(names: Sequence[str]) -> Any:  # noqa: ANN401 (a type built at run time)
    """``Literal[names]``: the schema names every value an operator may give (anything else is
    422), since which sources exist is the service's configuration."""
    return Literal.__getitem__(tuple(names))


class ReplayIn(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a field it does not know (a typo, an actor) is 422

    source: str = "outbox"
    ids: list[uuid.UUID] = Field(min_length=1, max_length=1000)


def replay_body(tables: Sequence[str]) -> type[ReplayIn]:
    """:class:`ReplayIn` whose ``source`` is one of this service's tables."""
    return create_model("ReplayIn", __base__=ReplayIn, source=(one_of(tables), "outbox"))


def administration(request: Request) -> RelayAdministration:
    admin = request.app.state.outbox_admin
    assert isinstance(admin, RelayAdministration)  # noqa: S101 (set by create_app)
    return admin


Service = Annotated[RelayAdministration, Depends(administration)]


def fail(error: AdminError) -> HTTPException:
    status = 400
    if isinstance(error, RowNotFoundError):
        status = 404
    elif isinstance(error, NothingToReplayError):
        status = 409  # the rows' state, not the request, is why: already replayed, say
    return HTTPException(status_code=status, detail=str(error))


def administrator_of(admin_role: str, operator_role: str) -> Callable[[Request], Administrator]:
    """The caller and its scope: every tenant for the operator role, its own for the admin role."""
    either_role = require_role(admin_role, operator_role)

    def administrator(request: Request, _bearer: Bearer = None) -> Administrator:
        context = either_role(request)
        if context.has_role(operator_role):
            return Administrator(context, EVERY_TENANT)
        return Administrator(context, TenantScope(context.tenant_id))

    return administrator


def build_admin_router(admin_role: str, operator_role: str, targets: Targets) -> APIRouter:
    """The admin API; ``targets`` says which tables and sources a request may name (in a query,
    leaving the source out means every table of every source)."""
    router = APIRouter(prefix="/admin/outbox", tags=["admin"], responses=error_responses(400, 401, 403))
    admin = Annotated[Administrator, Depends(administrator_of(admin_role, operator_role))]
    _add_dead_letter_routes(router, admin, one_of(targets.selections), replay_body(targets.tables))
    _add_row_routes(router, admin, one_of(targets.selections), one_of(targets.tables))
    return router


def _add_dead_letter_routes(router: APIRouter, Admin: Any, Selection: Any, Replay: Any) -> None:  # noqa: N803, ANN401 (types built at run time)
    @router.get("/dead-letters")
    async def list_dead_letters(
        admin: Admin,
        service: Service,
        source: Selection | None = None,
        offset: Annotated[int, Query(ge=0, le=MAX_OFFSET)] = 0,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 50,
    ) -> list[dict[str, Any]]:
        try:
            letters = await service.list_dead_letters(source, offset=offset, limit=limit, scope=admin.scope)
            return [asdict(d) for d in letters]
        except AdminError as error:
            raise fail(error) from error

    @router.post("/dead-letters/replay", responses=error_responses(404, 409))
    async def replay(body: Replay, admin: Admin, service: Service) -> dict[str, Any]:
        try:
            actor = admin.context.user_id or "unknown"
            ids = [str(row_id) for row_id in body.ids]
            result = await service.replay(body.source, ids, actor=actor, scope=admin.scope)
        except AdminError as error:
            raise fail(error) from error
        return asdict(result)


def _add_row_routes(router: APIRouter, Admin: Any, Selection: Any, Table: Any) -> None:  # noqa: N803, ANN401 (types built at run time)
    @router.get("/pending")
    async def pending(
        admin: Admin, service: Service, source: Selection | None = None
    ) -> list[dict[str, Any]]:
        try:
            return [asdict(c) for c in await service.count_pending(source, scope=admin.scope)]
        except AdminError as error:
            raise fail(error) from error

    @router.get("/{source}/{row_id}/explain", responses=error_responses(404))
    async def explain(source: Table, row_id: uuid.UUID, admin: Admin, service: Service) -> dict[str, Any]:
        try:
            return asdict(await service.explain(source, str(row_id), scope=admin.scope))
        except AdminError as error:
            raise fail(error) from error


# -- the AsyncAPI document ----------------------------------------------------------------


def _key(name: str) -> str:
    return name.replace(".", "_").replace("-", "_")


def public_server(url: str | None, protocol: str) -> dict[str, str]:
    """The AsyncAPI server object of a broker URL, without credentials or query.

    Handles ``scheme://user:pass@host:port/path?query`` and Kafka's scheme-less
    ``user:pass@host1:9092,host2:9092`` bootstrap lists."""
    if not url:
        return {"host": "in-process", "protocol": protocol}
    parts = urlsplit(url if "://" in url else f"//{url}")
    hosts = ",".join(host.rpartition("@")[2] for host in parts.netloc.rpartition("@")[2].split(","))
    server = {"host": hosts, "protocol": protocol}
    if parts.path not in {"", "/"}:
        server["pathname"] = parts.path
    return server


def asyncapi_document(
    registry: MessageRegistry,
    handlers: HandlerRegistry,
    bus: MessageBusSettings,
    *,
    namespace: str,
    title: str,
    description: str,
) -> dict[str, Any]:
    """The document of a service called ``title``, whose broker names start with ``namespace``."""
    names = EndpointNames(namespace, bus.preserve_default_endpoint_names)
    prefix = "ce_" if bus.transport is Transport.KAFKA else "ce-"  # the CloudEvents binding's
    cloud_events = {
        f"{prefix}{name}": {"type": "string", "description": f"CloudEvents {name} (binary mode; not signed)"}
        for name in CLOUD_EVENT_ATTRIBUTES
    }
    headers_schema = {
        "type": "object",
        "properties": {**{h: {"type": "string"} for h in (*SIGNED_HEADERS, SIGNATURE)}, **cloud_events},
        "required": ["x-message-id", "x-event-name", f"{prefix}specversion", f"{prefix}id", f"{prefix}type"],
    }
    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    messages: dict[str, Any] = {}
    for event in registry.classes(IntegrationEvent):
        key = _key(event.message_name)
        messages[key] = {
            "name": event.message_name,
            "title": event.__name__,
            "summary": (event.__doc__ or "").strip().splitlines()[0] if event.__doc__ else "",
            "contentType": "application/json",
            "headers": headers_schema,
            "payload": event.model_json_schema(),
        }
        channels[key] = {
            "address": names.channel(event.message_name),
            "messages": {key: {"$ref": f"#/components/messages/{key}"}},
        }
        operations[f"publish_{key}"] = {
            "action": "send",
            "channel": {"$ref": f"#/channels/{key}"},
            "summary": "Published only by the outbox processor",
        }
    for consumer in handlers.consumers:
        key = _key(consumer.event_type.message_name)
        operations[f"consume_{_key(consumer.name)}"] = {
            "action": "receive",
            "channel": {"$ref": f"#/channels/{key}"},
            "summary": f"{consumer.name} (queue {names.queue(consumer.name)}, deduplicated by the inbox)",
        }
    return {
        "asyncapi": "3.0.0",
        "info": {"title": title, "version": "1.0.0", "description": description},
        "defaultContentType": "application/json",
        "servers": {"default": public_server(bus.url, bus.transport.value)},
        "channels": channels,
        "operations": operations,
        "components": {"messages": messages},
    }
