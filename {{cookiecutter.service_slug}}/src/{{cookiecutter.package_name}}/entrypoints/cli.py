"""``python -m <package> <command>``: run, api, worker, migrate, token, outbox, asyncapi.

Configuration errors (a refused combination of settings, a bad value) print one line per
problem and exit with status 2 instead of a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence

from outbox_kit.runtime.http import InvalidTokenError

from ..about import SERVICE_NAME
from ..container import Container, build_container
from . import migrations
from .cli_errors import EXIT_CONFIG, CliError, load_settings
from .cli_outbox import login_name, run_outbox_command
from .logging_setup import configure_logging
from .serving import listening_socket, refuse_the_published_secret_beyond_loopback, serve
from .worker_process import run_worker, serve_worker


def _token(args: argparse.Namespace, container: Container) -> None:
    settings = container.settings()
    if settings.is_production:
        msg = "token minting is a development helper and is refused in production"
        raise CliError(msg)
    roles = tuple(r.strip() for r in args.roles.split(",") if r.strip())
    tokens = container.tokens()
    token = tokens.mint(user_id=args.user, tenant_id=args.tenant, roles=roles)
    try:
        tokens.verify(token)  # the API's own checks: a token it would refuse is not printed
    except InvalidTokenError as error:
        raise CliError(str(error).removeprefix("invalid bearer token: ")) from None
    print(token)


def _asyncapi(args: argparse.Namespace, container: Container) -> None:
    from .health import service_asyncapi  # noqa: PLC0415

    document = json.dumps(service_asyncapi(container), indent=2)
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
    worker = commands.add_parser("worker", help="processors and consumers until SIGTERM")
    worker.add_argument("--host", default=None, help="default WORKER__HOST (127.0.0.1)")
    worker.add_argument(
        "--port", type=int, default=None, help="serve /livez, /readyz, /metrics (default WORKER__PORT: none)"
    )
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
        default=f"cli:{login_name()}",
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
    settings = load_settings()
    configure_logging(settings.logging)
    container = build_container(settings)
    if args.command in ("run", "api"):
        host = args.host or settings.api.host
        port = settings.api.port if args.port is None else args.port
        refuse_the_published_secret_beyond_loopback(settings, host)
        listening = listening_socket(host, port)
        asyncio.run(serve(container, listening, with_worker=args.command == "run"))
    elif args.command == "worker":
        port = settings.worker.port if args.port is None else args.port
        if port is None:
            asyncio.run(run_worker(container))
        else:
            listening = listening_socket(args.host or settings.worker.host, port)
            asyncio.run(serve_worker(container, listening))
    elif args.command == "migrate":
        migrations.upgrade(settings.database.url, args.revision)
    elif args.command == "token":
        _token(args, container)
    elif args.command == "asyncapi":
        _asyncapi(args, container)
    elif args.command == "outbox":
        run_outbox_command(args, container)
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
