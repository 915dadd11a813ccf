"""Serving HTTP: run (API and worker in one process), api, and the worker's probes, each on a
socket bound before anything starts; the development banner (what to try first, credentials
masked); and the refusal to serve the published development secret beyond loopback."""

from __future__ import annotations

import errno
import ipaddress
import signal
import socket
import sys
from typing import TYPE_CHECKING

from outbox_kit.application.text import mask_credentials

from ..about import SERVICE_NAME
from ..container import Container
from ..settings import DEV_JWT_SECRET, ServiceSettings
from .cli_errors import CliError
from .stopping import FORCE_EXIT_STATE

if TYPE_CHECKING:
    from fastapi import FastAPI


def listening_socket(host: str, port: int) -> socket.socket:
    """Bind before anything starts, so a port already taken is one clear line, not a banner
    followed by a server's traceback."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return socket.create_server((host, port), family=family)  # SO_REUSEADDR, as uvicorn binds
    except OSError as error:
        reason = "already in use" if error.errno == errno.EADDRINUSE else error.strerror or str(error)
        msg = f"cannot listen on {host}:{port}: {reason} (pass --port, or stop what listens there)"
        raise CliError(msg) from None


def bound_port(listening: socket.socket) -> int:
    return int(listening.getsockname()[1])


async def serve(container: Container, listening: socket.socket, *, with_worker: bool) -> None:
    """``run`` and ``api``: the API (and, for ``run``, the worker) on ``listening``."""
    from .app import create_app  # noqa: PLC0415

    settings = container.settings()
    app = create_app(container, with_worker=with_worker)
    if settings.environment.value == "development":
        base = f"http://{socket_host(listening)}:{bound_port(listening)}"
        print_banner(settings, app, base, with_worker=with_worker)
    await serve_app(app, listening, settings)


async def serve_app(app: FastAPI, listening: socket.socket, settings: ServiceSettings) -> None:
    """Serve ``app`` with uvicorn on an already bound socket until SIGTERM or SIGINT, with the
    time limits for slow clients (``API__HEADER_READ_TIMEOUT_SECONDS`` and the keep-alive).

    After the signal, requests still running after ``API__SHUTDOWN_TIMEOUT_SECONDS`` are
    cancelled (their transactions roll back), so one stuck on a lock or a silent dependency
    cannot hold the process; then the lifespan stops the rest within its own deadline."""
    import uvicorn  # noqa: PLC0415 (not needed by the other commands)
    from outbox_kit.runtime.server import server_config  # noqa: PLC0415 (imports uvicorn)

    server = uvicorn.Server(server_config(app, settings.api, settings.logging.level))
    setattr(app.state, FORCE_EXIT_STATE, True)  # a process of its own: see ``stopping``
    # uvicorn shuts down gracefully on SIGTERM/SIGINT, then re-raises the signal to whatever
    # handler was installed before it: make that a no-op, so a graceful stop exits with 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _already_stopped)
    await server.serve(sockets=[listening])


def socket_host(listening: socket.socket) -> str:
    host = str(listening.getsockname()[0])
    return f"[{host}]" if ":" in host else host


ORDER_EXAMPLE = '{"customer_id": "c-1", "lines": [{"sku": "BOOK", "quantity": 2, "unit_price": "9.99"}]}'


def print_banner(settings: ServiceSettings, app: FastAPI, base: str, *, with_worker: bool) -> None:
    """What is running and what to try first (development mode only)."""
    package = __package__.rpartition(".")[0]
    token = f"TOKEN=$({sys.executable} -m {package} token --tenant acme --user alice --roles outbox-admin)"
    auth = '-H "Authorization: Bearer $TOKEN"'
    # The OpenAPI paths, not ``app.routes``: an included router's routes are not listed there
    # with their paths in every FastAPI version, and then the banner forgot the example's calls.
    if "/orders" in app.openapi().get("paths", {}):
        tries = [
            (
                f"curl -s -X POST {base}/orders {auth} -H 'Content-Type: application/json' "
                f"-d '{ORDER_EXAMPLE}'"
            ),
            f"curl -s {base}/notifications?order_id=<id> {auth}",
        ]
    else:  # generated without the example: the service's own surface
        tries = [f"curl -s {base}/readyz", f"curl -s {base}/admin/outbox/pending {auth}"]
    lines = [
        (
            f"{SERVICE_NAME} on {base} ({'API + worker' if with_worker else 'API only'}; "
            f"{mask_credentials(settings.database.url)}; transport {settings.message_bus.transport.value}; "
            f"outbox {'on' if settings.message_bus.outbox_enabled else 'off'})."
        ),
        f"  Try:  {token}",
        *(f"        {line}" for line in tries),
        f"  Docs: {base}/docs   Metrics: {base}/metrics   AsyncAPI: {base}/asyncapi",
    ]
    print("\n".join(lines), file=sys.stderr, flush=True)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name or "": it may resolve to (or mean) any interface
        return False


def refuse_the_published_secret_beyond_loopback(settings: ServiceSettings, host: str) -> None:
    """The default JWT secret is in the template for everyone to read: with it, anyone could
    mint an admin token, so it never serves beyond this machine (production refuses it anyway)."""
    if settings.auth.jwt_secret.get_secret_value() == DEV_JWT_SECRET and not is_loopback(host):
        msg = (
            f"AUTH__JWT_SECRET is the published development default, served on loopback only "
            f"(anyone could mint tokens for it): set a secret of your own to listen on {host!r}"
        )
        raise CliError(msg)


def _already_stopped(_signal: int, _frame: object) -> None:
    """The server has already shut down gracefully when uvicorn re-raises the signal."""
