"""``python -m <package> <command>``: run, api, worker, migrate, token, outbox, asyncapi.

Configuration errors (a refused combination of settings, a bad value) print one line per
problem and exit with status 2 instead of a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import ipaddress
import json
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict
from datetime import datetime
from typing import TYPE_CHECKING, TypeVar

from pydantic import ValidationError

from ..about import SERVICE_NAME
from ..building_blocks.kernel.redaction import mask_credentials
from ..building_blocks.operations.admin import RelayAdministration
from ..building_blocks.operations.requests import EVERY_TENANT, AdminError, TenantScope
from ..container import Container, build_container
from ..settings import DEV_JWT_SECRET, Settings
from . import migrations

if TYPE_CHECKING:
    from fastapi import FastAPI
from .logging_setup import configure_logging

EXIT_CONFIG = 2
T = TypeVar("T")


class CliError(Exception):
    """A problem the user can fix; printed as one line."""


def _settings() -> Settings:
    try:
        return Settings()
    except ValidationError as error:
        lines = [
            f"configuration error: {'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg']}"
            for e in error.errors()
        ]
        raise CliError("\n".join(lines)) from None


def _json_default(value: object) -> str:
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


def _print_json(data: object) -> None:
    print(json.dumps(data, indent=2, default=_json_default))


async def _serve(container: Container, host: str, port: int, *, with_worker: bool) -> None:
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


def _refuse_the_published_secret_beyond_loopback(settings: Settings, host: str) -> None:
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


async def _run_worker(container: Container) -> None:
    from ..container import startup_diagnostics  # noqa: PLC0415

    startup_diagnostics(container)
    bus = container.bus()
    await bus.start()
    worker = container.worker()
    await worker.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await worker.stop()  # processors first, then consumers and the connection
    await container.database().dispose()
    container.tracing().shutdown()


async def _with_admin(container: Container, action: Callable[[RelayAdministration], Awaitable[T]]) -> T:
    try:
        return await action(container.admin())
    except AdminError as error:
        raise CliError(str(error)) from None
    finally:
        await container.database().dispose()


def _outbox(args: argparse.Namespace, container: Container) -> None:
    # An operator tool: every tenant unless --tenant narrows it.
    scope = TenantScope(args.tenant) if args.tenant else EVERY_TENANT
    if args.outbox_command == "pending":
        counts = asyncio.run(_with_admin(container, lambda a: a.count_pending(args.source, scope=scope)))
        _print_json([asdict(c) for c in counts])
    elif args.outbox_command == "dead-letters":
        letters = asyncio.run(
            _with_admin(
                container,
                lambda a: a.list_dead_letters(args.source, offset=args.offset, limit=args.limit, scope=scope),
            )
        )
        _print_json([asdict(d) for d in letters])
    elif args.outbox_command == "replay":
        result = asyncio.run(
            _with_admin(container, lambda a: a.replay(args.source, args.ids, actor=args.actor, scope=scope))
        )
        _print_json(asdict(result))
    elif args.outbox_command == "explain":
        explanation = asyncio.run(
            _with_admin(container, lambda a: a.explain(args.source, args.id, scope=scope))
        )
        _print_json(asdict(explanation))


def _token(args: argparse.Namespace, container: Container) -> None:
    settings = container.settings()
    if settings.is_production:
        msg = "token minting is a development helper and is refused in production"
        raise CliError(msg)
    roles = tuple(r.strip() for r in args.roles.split(",") if r.strip())
    print(container.tokens().mint(user_id=args.user, tenant_id=args.tenant, roles=roles))


def _login_name() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no login name (a container with an unnamed uid)
        return "unknown"


def _asyncapi(args: argparse.Namespace, container: Container) -> None:
    from ..building_blocks.brokers.asyncapi import asyncapi_document  # noqa: PLC0415

    document = json.dumps(
        asyncapi_document(container.registry(), container.handlers(), container.settings()), indent=2
    )
    if args.output:
        with open(args.output, "w", encoding="utf-8") as file:  # noqa: PTH123
            file.write(document + "\n")
    else:
        print(document)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"python -m {__package__.rpartition('.')[0]}", description=SERVICE_NAME
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for name, text in (("run", "API and worker in one process (the embedded default)"), ("api", "API only")):
        serve = commands.add_parser(name, help=text)
        serve.add_argument("--host", default=None, help="default API__HOST (127.0.0.1)")
        serve.add_argument("--port", type=int, default=None, help="default API__PORT (8000)")
    commands.add_parser("worker", help="processors and consumers until SIGTERM")
    migrate = commands.add_parser("migrate", help="apply the database migrations")
    migrate.add_argument("--revision", default="head")
    token = commands.add_parser("token", help="print a development JWT")
    token.add_argument("--tenant", required=True)
    token.add_argument("--user", required=True)
    token.add_argument("--roles", default="")
    asyncapi = commands.add_parser("asyncapi", help="print (or write) the AsyncAPI document")
    asyncapi.add_argument("--output", default=None)
    outbox = commands.add_parser("outbox", help="operate the outbox").add_subparsers(
        dest="outbox_command", required=True
    )
    pending = outbox.add_parser("pending", help="count rows not yet delivered")
    pending.add_argument("--source", default=None)
    letters = outbox.add_parser("dead-letters", help="list dead letters, oldest first")
    letters.add_argument("--source", default=None)
    letters.add_argument("--offset", type=int, default=0)
    letters.add_argument("--limit", type=int, default=50)
    replay = outbox.add_parser("replay", help="return dead letters to the pending pool")
    replay.add_argument("--source", default="outbox")
    replay.add_argument(
        "--actor",
        default=f"cli:{_login_name()}",
        help="who replays, recorded with the replay (default: cli:<your login name>)",
    )
    replay.add_argument("ids", nargs="+")
    explain = outbox.add_parser("explain", help="say why a row is or is not moving")
    explain.add_argument("--source", default="outbox")
    explain.add_argument("id")
    for command in (pending, letters, replay, explain):
        command.add_argument("--tenant", default=None, help="only this tenant's rows (default: every tenant)")
    return parser


def run(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings = _settings()
    configure_logging(settings.logging)
    container = build_container(settings)
    if args.command in ("run", "api"):
        host = args.host or settings.api.host
        port = settings.api.port if args.port is None else args.port
        _refuse_the_published_secret_beyond_loopback(settings, host)
        asyncio.run(_serve(container, host, port, with_worker=args.command == "run"))
    elif args.command == "worker":
        asyncio.run(_run_worker(container))
    elif args.command == "migrate":
        migrations.upgrade(settings.database.url, args.revision)
    elif args.command == "token":
        _token(args, container)
    elif args.command == "asyncapi":
        _asyncapi(args, container)
    elif args.command == "outbox":
        _outbox(args, container)
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    try:
        code = run(argv)
    except CliError as error:
        print(f"error: {error}", file=sys.stderr)
        code = EXIT_CONFIG
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)
