"""Serving HTTP: run (API and worker in one process) and api, with the development banner (what to
try first, credentials masked), and the refusal to serve the published development secret beyond
loopback."""

from __future__ import annotations

import ipaddress
import signal
import sys
from typing import TYPE_CHECKING

from ..about import SERVICE_NAME
from ..building_blocks.kernel.redaction import mask_credentials
from ..container import Container
from ..settings import DEV_JWT_SECRET, Settings
from .cli_errors import CliError

if TYPE_CHECKING:
    from fastapi import FastAPI


async def serve(container: Container, host: str, port: int, *, with_worker: bool) -> None:
    import uvicorn  # noqa: PLC0415 (not needed by the other commands)

    from .app import create_app  # noqa: PLC0415

    settings = container.settings()
    app = create_app(container, with_worker=with_worker)
    config = uvicorn.Config(
        app, host=host, port=port, log_config=None, lifespan="on", log_level=settings.logging.level.lower()
    )
    server = uvicorn.Server(config)
    if settings.environment.value == "development":
        print_banner(settings, app, f"http://{host}:{port}", with_worker=with_worker)
    # uvicorn shuts down gracefully on SIGTERM/SIGINT, then re-raises the signal to whatever
    # handler was installed before it: make that a no-op, so a graceful stop exits with 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _already_stopped)
    await server.serve()


ORDER_EXAMPLE = '{"customer_id": "c-1", "lines": [{"sku": "BOOK", "quantity": 2, "unit_price": "9.99"}]}'


def print_banner(settings: Settings, app: FastAPI, base: str, *, with_worker: bool) -> None:
    """What is running and what to try first (development mode only)."""
    package = __package__.rpartition(".")[0]
    token = f"TOKEN=$({sys.executable} -m {package} token --tenant acme --user alice --roles outbox-admin)"
    auth = '-H "Authorization: Bearer $TOKEN"'
    if any(getattr(route, "path", None) == "/orders" for route in app.routes):
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


def refuse_the_published_secret_beyond_loopback(settings: Settings, host: str) -> None:
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
