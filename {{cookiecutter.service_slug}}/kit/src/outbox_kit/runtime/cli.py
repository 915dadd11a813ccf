"""The command line of a service, ``python -m <package> <command>``: run, api, worker, migrate,
token, outbox, asyncapi. A service's ``__main__`` calls :func:`main` with its settings type and
its ``build_container``; everything else is here.

Configuration errors (a refused combination of settings, a bad value, a port already taken)
print one line per problem and exit with status 2 instead of a traceback.

The outbox commands (pending, dead-letters, replay, explain) are an operator tool: they see
every tenant unless ``--tenant`` narrows it, print JSON, and record a replay as
``cli:<login name>`` by default.

Logging is process-wide: readable lines by default, JSON lines with ``LOGGING__JSON_FORMAT``.
The service logs values from outside (message ids, header values, error texts of rejected
messages), so a record must not be able to forge another: in the text format every record is one
line starting with its time, the rendered line has its control characters escaped (a newline in
a message id cannot start a forged record, an ESC cannot repaint a terminal, a lone surrogate
cannot break the write), and the lines of a traceback or stack follow it indented. Escaping
there, once, covers every log call. The JSON format needs nothing more: ``json.dumps`` escapes
control characters and surrogates inside each value. In both formats a URL's password is masked,
in the message and in the traceback (``outbox_kit.application.text``).

Migrations are the service's Alembic scripts: ``alembic.ini`` and ``migrations/`` of its project
(``ALEMBIC_CONFIG``, the working directory, or the project root given to :func:`main`).
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import getpass
import importlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar, cast

from pydantic import ValidationError

import outbox_kit

if TYPE_CHECKING:
    from alembic.config import Config

    from outbox_kit.operations.admin import RelayAdministration
    from outbox_kit.runtime.container import OutboxContainer
    from outbox_kit.runtime.settings import LoggingSettings, ServiceSettings

# The rest of the kit is imported by the command that needs it: `--help` answers without
# importing a database driver, a broker client or a web framework, and `token` or `outbox` load
# none of the server.
log = logging.getLogger(__name__)

SELECTION_HELP = "a table (outbox, internal_commands, <source>.outbox) or a source; default: every table"
TABLE_HELP = "the table: outbox, internal_commands, <source>.outbox or <source>.internal_commands"
T = TypeVar("T")
SettingsT = TypeVar("SettingsT", bound="ServiceSettings")
EXIT_CONFIG = 2


class CliError(Exception):
    """A problem the user can fix; printed as one line."""


def _token(args: argparse.Namespace, container: OutboxContainer, env_file: Path) -> None:
    """Print a development token on stdout (only the token: ``TOKEN=$(...)`` works) and, on
    stderr, what it was signed with and stamped with, so a token the server refuses is explained
    before it is sent."""
    from outbox_kit.runtime.identity_provider import InvalidTokenError

    settings = container.settings()
    if settings.is_production:
        msg = "token minting is a development helper and is refused in production"
        raise CliError(msg)
    source = secret_source(settings, env_file)
    roles = tuple(r.strip() for r in args.roles.split(",") if r.strip())
    tokens = container.tokens()
    token = tokens.mint(user_id=args.user, tenant_id=args.tenant, roles=roles)
    try:
        tokens.verify(token)  # the API's own checks: a token it would refuse is not printed
    except InvalidTokenError as error:
        raise CliError(str(error).removeprefix("invalid bearer token: ")) from None
    auth = settings.auth
    print(
        f"token: signed with AUTH__JWT_SECRET from {source}; issuer "
        f"{auth.expected_issuer or '(none)'}; audience {auth.jwt_audience or '(none)'}",
        file=sys.stderr,
    )
    print(token)


SECRET_VARIABLE = "AUTH__JWT_SECRET"  # noqa: S105 (a variable's name, not a secret)


def secret_source(settings: ServiceSettings, env_file: Path) -> str:
    """Where the JWT secret in effect comes from: the environment, ``env_file``, or the built-in
    development default, which is refused (a :class:`CliError`) while a ``.env`` of the working
    directory names another: a token signed with it would be refused by the server."""
    from dotenv import dotenv_values

    from outbox_kit.runtime.settings import DEV_JWT_SECRET

    if any(name.upper() == SECRET_VARIABLE for name in os.environ):
        return "the environment"
    if env_file.is_file() and _names_secret(dotenv_values(env_file)):
        return str(env_file)
    other = Path(".env").resolve()
    in_effect = settings.auth.jwt_secret.get_secret_value()
    if in_effect == DEV_JWT_SECRET and other.is_file() and _names_secret(dotenv_values(other)):
        msg = (
            f"{other} sets {SECRET_VARIABLE}, but the service's settings ({env_file}) do not: the "
            "token would be signed with the built-in development secret; run the command from the "
            "service's folder or set the secret in its .env"
        )
        raise CliError(msg)
    return "the built-in development default (no .env or environment sets it)"


def _names_secret(values: dict[str, str | None]) -> bool:
    from outbox_kit.runtime.settings import DEV_JWT_SECRET

    return any(
        name.upper() == SECRET_VARIABLE and value and value != DEV_JWT_SECRET
        for name, value in values.items()
    )


def _asyncapi(args: argparse.Namespace, container: OutboxContainer) -> None:
    from outbox_kit.runtime.app import service_asyncapi

    document = json.dumps(service_asyncapi(container), indent=2)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as file:  # noqa: PTH123
            file.write(document + "\n")
    else:
        print(document)


def build_parser(
    settings_type: type[ServiceSettings] | str, description: str | None = None
) -> argparse.ArgumentParser:
    """The commands; ``settings_type`` may be a reference (``"package.settings:Settings"``), so
    that building the parser imports nothing of the service."""
    if isinstance(settings_type, str):
        module = settings_type.partition(":")[0]
    else:
        module, description = settings_type.__module__, description or settings_type.service_name
    parser = argparse.ArgumentParser(prog=f"python -m {module.partition('.')[0]}", description=description)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, text in (("run", "API and worker in one process (the embedded default)"), ("api", "API only")):
        serve = commands.add_parser(name, help=text)
        serve.add_argument("--host", default=None, help="default API__HOST (127.0.0.1)")
        serve.add_argument("--port", type=int, default=None, help="default API__PORT (8000)")
        serve.add_argument("--reload", action="store_true", help=RELOAD_HELP)
    worker = commands.add_parser("worker", help="processors and consumers until SIGTERM")
    worker.add_argument("--host", default=None, help="default WORKER__HOST (127.0.0.1)")
    worker.add_argument("--reload", action="store_true", help=RELOAD_HELP)
    worker.add_argument(
        "--port", type=int, default=None, help="serve /livez, /readyz, /metrics (default WORKER__PORT: none)"
    )
    migrate = commands.add_parser("migrate", help="apply the database migrations, in every source")
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
    pending.add_argument("--source", default=None, help=SELECTION_HELP)
    letters = outbox.add_parser("dead-letters", help="list dead letters, oldest first")
    letters.add_argument("--source", default=None, help=SELECTION_HELP)
    letters.add_argument("--offset", type=int, default=0)
    letters.add_argument("--limit", type=int, default=50)
    replay = outbox.add_parser("replay", help="return dead letters to the pending pool")
    replay.add_argument("--source", default="outbox", help=TABLE_HELP)
    replay.add_argument(
        "--actor",
        default=f"cli:{login_name()}",
        help="who replays, recorded with the replay (default: cli:<your login name>)",
    )
    replay.add_argument("ids", nargs="+")
    explain = outbox.add_parser("explain", help="say why a row is or is not moving")
    explain.add_argument("--source", default="outbox", help=TABLE_HELP)
    explain.add_argument("id")
    for operation in (pending, letters, replay, explain):
        operation.add_argument(
            "--tenant", default=None, help="only this tenant's rows (default: every tenant)"
        )
    return parser


def env_file_of(project: Path) -> Path:
    """The ``.env`` a command reads: the service's own, in its project folder, wherever the
    command runs (``TOKEN=$(... token ...)`` pasted in another folder signed with the built-in
    secret); the working directory's when the project has none (an installed copy)."""
    own = project / ".env"
    return own if own.is_file() else Path(".env")


def load_settings(settings_type: type[SettingsT], env_file: Path | None = None) -> SettingsT:
    """The settings from the environment and ``env_file`` (default: the working directory's
    ``.env``); a refused value is a :class:`CliError` with one line per problem."""
    try:
        return settings_type(_env_file=env_file or Path(".env"))
    except ValidationError as error:
        lines = [
            f"configuration error: {'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg']}"
            for e in error.errors()
        ]
        raise CliError("\n".join(lines)) from None


def run(
    settings_type: type[SettingsT] | str,
    build_container: Callable[[SettingsT], OutboxContainer] | str,
    *,
    project: Path,
    argv: Sequence[str] | None = None,
    description: str | None = None,
) -> int:
    """Run one command; ``project`` is the folder of the service's ``alembic.ini`` and of the
    ``.env`` every command reads (see :func:`env_file_of`).

    ``settings_type`` and ``build_container`` may be given as references (``"module:name"``),
    imported only once the arguments are parsed: a service's ``__main__`` does, so ``--help``
    (and a mistyped command) answers at once."""
    args = build_parser(settings_type, description).parse_args(argv)
    env_file = env_file_of(project)
    settings = load_settings(resolve(settings_type), env_file)
    configure_logging(settings.logging)
    configure_error_tracking(settings)
    build: Callable[[SettingsT], OutboxContainer] = resolve(build_container)
    if getattr(args, "reload", False):
        return reload_on_change(settings, build)
    container = build(settings)
    if args.command != "token":  # every other command reaches the contexts' storage
        refuse_unusable_sources(container)
    if args.command == "migrate":  # the service's scripts, once per source
        migrate(project, container, args.revision)
        return 0
    if args.command in ("run", "api", "worker"):
        _serve(args, settings, container)
    elif args.command == "token":
        _token(args, container, env_file)
    elif args.command == "asyncapi":
        _asyncapi(args, container)
    elif args.command == "outbox":
        run_outbox_command(args, container)
    return 0


def refuse_unusable_sources(container: OutboxContainer) -> None:
    """``SOURCES__...`` that cannot be honoured (an unknown context, a schema on SQLite, two
    contexts on one storage) end the command with the reason, like any refused setting."""
    from outbox_kit.runtime.sources import SourcesError, plan_sources

    try:
        plan_sources(container.settings(), container.modules())
    except SourcesError as error:
        msg = f"configuration error: {error}"
        raise CliError(msg) from None


def resolve(reference: T | str) -> T:
    """An object, or the object a ``"module:name"`` reference names."""
    if not isinstance(reference, str):
        return reference
    module, _, name = reference.partition(":")
    return cast("T", getattr(importlib.import_module(module), name))


def _serve(args: argparse.Namespace, settings: ServiceSettings, container: OutboxContainer) -> None:
    from outbox_kit.runtime.server import run_worker, serve, serve_worker

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


def main(
    settings_type: type[SettingsT] | str,
    build_container: Callable[[SettingsT], OutboxContainer] | str,
    *,
    project: Path,
    argv: Sequence[str] | None = None,
    description: str | None = None,
) -> None:
    """A service's ``__main__``: :func:`run`, exiting with its status (2 for a :class:`CliError`,
    printed as ``error: ...``)."""
    try:
        code = run(settings_type, build_container, project=project, argv=argv, description=description)
    except CliError as error:
        print(f"error: {error}", file=sys.stderr)
        code = EXIT_CONFIG
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


RELOAD_HELP = "development: start again when a Python file of the service changes"


def reload_on_change(settings: ServiceSettings, build_container: Callable[..., OutboxContainer]) -> int:
    """``--reload``: the same command, without the flag, in a child process started again each
    time a Python file of the service (or of a kit checked out beside it) changes.

    The child is stopped with SIGTERM, its graceful shutdown: a Ctrl-C in the terminal has already
    sent it SIGINT, and a second SIGINT would make uvicorn force its exit. A child that exits on
    its own (an error in the code just saved) is started again by the next change."""
    if settings.is_production:
        msg = "--reload is a development convenience and is refused in production"
        raise CliError(msg)
    try:
        import watchfiles
    except ImportError:
        msg = "--reload needs watchfiles, one of the service's development tools: run `make install`"
        raise CliError(msg) from None
    command = [sys.executable, *(argument for argument in sys.orig_argv[1:] if argument != "--reload")]
    paths = watched_paths(build_container)
    signal.signal(signal.SIGTERM, _interrupt)  # `docker compose stop`, `kill`: as Ctrl-C
    # Ctrl-C even when started with it ignored (a script's background job): the server it runs
    # answers Ctrl-C all the same (uvicorn installs its own handler), so ignoring it here would
    # leave this process watching files with no server behind it, and its `make` waiting for it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    logging.getLogger("watchfiles").setLevel(logging.ERROR)  # its "stopping watch" at every Ctrl-C
    log.info("reloading on changes under %s", ", ".join(map(str, paths)))
    child = subprocess.Popen(command)  # noqa: S603 (this very command, re-run)
    try:
        for changes in watchfiles.watch(
            *paths, watch_filter=watchfiles.PythonFilter(), raise_interrupt=False
        ):
            log.info("%d file(s) changed: starting again", len(changes))
            _stop_child(child)
            child = subprocess.Popen(command)  # noqa: S603
    finally:
        _stop_child(child)
    return 0


# How long a child gets for its graceful shutdown before it is killed.
RELOAD_STOP_SECONDS = 15


def _interrupt(_signal: int, _frame: object) -> None:
    raise KeyboardInterrupt


def _stop_child(child: subprocess.Popen[bytes]) -> None:
    if child.poll() is None:
        child.terminate()
    try:
        child.wait(RELOAD_STOP_SECONDS)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def watched_paths(build_container: Callable[..., OutboxContainer]) -> list[Path]:
    """The service's package, and the kit's when it is a checkout (not an installed wheel)."""
    package = sys.modules[build_container.__module__.partition(".")[0]]
    paths = [Path(package.__file__ or ".").parent]
    kit = Path(outbox_kit.__file__ or ".").parent
    if "site-packages" not in kit.parts and kit not in paths and not kit.is_relative_to(paths[0]):
        paths.append(kit)
    return paths


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


def refuse_the_published_secret_beyond_loopback(settings: ServiceSettings, host: str) -> None:
    """The default JWT secret is in the template for everyone to read: with it, anyone could
    mint an admin token, so it never serves beyond this machine (production refuses it anyway)."""
    from outbox_kit.runtime.settings import DEV_JWT_SECRET
    from outbox_kit.runtime.tokens import is_loopback

    if settings.auth.jwt_secret.get_secret_value() == DEV_JWT_SECRET and not is_loopback(host):
        msg = (
            f"AUTH__JWT_SECRET is the published development default, served on loopback only "
            f"(anyone could mint tokens for it): set a secret of your own to listen on {host!r}"
        )
        raise CliError(msg)


def _json_default(value: object) -> str:
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


def _print_json(data: object) -> None:
    print(json.dumps(data, indent=2, default=_json_default))


async def _with_admin(container: OutboxContainer, action: Callable[[RelayAdministration], Awaitable[T]]) -> T:
    from outbox_kit.operations.rows import AdminError

    try:
        return await action(container.admin())
    except AdminError as error:
        raise CliError(str(error)) from None
    finally:
        await container.database().dispose()


def run_outbox_command(args: argparse.Namespace, container: OutboxContainer) -> None:
    from outbox_kit.operations.rows import EVERY_TENANT, TenantScope

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


def login_name() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no login name (a container with an unnamed uid)
        return "unknown"


def configure_error_tracking(settings: ServiceSettings) -> None:
    from outbox_kit.application import error_tracking
    from outbox_kit.runtime.settings import secret_values

    sentry = settings.sentry
    error_tracking.configure_error_tracking(
        dsn=sentry.dsn.get_secret_value(),
        environment=sentry.environment or settings.environment.value,
        release=sentry.release,
        sample_rate=sentry.sample_rate,
        secrets=secret_values(settings),  # replaced by value in every event
    )


def configure_logging(settings: LoggingSettings) -> None:
    from outbox_kit.application.logs import TEXT_FORMAT, ContextFilter, JsonFormatter, TextFormatter
    from outbox_kit.application.text import CredentialMaskingFilter

    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(ContextFilter())
    handler.addFilter(CredentialMaskingFilter())  # after the context: it reads the final message
    handler.setFormatter(JsonFormatter() if settings.json_format else TextFormatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.level.upper())


def alembic_config(project: Path, database_url: str | None = None, schema: str | None = None) -> Config:
    """The service's ``alembic.ini`` (``ALEMBIC_CONFIG``, the working directory, or
    ``project``), pointed at ``database_url`` and ``schema`` (a source's) when given."""
    from alembic.config import Config

    candidates = [os.environ.get("ALEMBIC_CONFIG"), "alembic.ini", str(project / "alembic.ini")]
    path = next((Path(c) for c in candidates if c and Path(c).is_file()), None)
    if path is None:
        msg = "alembic.ini not found: run from the project root or set ALEMBIC_CONFIG"
        raise FileNotFoundError(msg)
    config = Config(str(path))
    config.set_main_option("script_location", str(path.parent / "migrations"))
    if database_url:
        config.attributes["database_url"] = database_url
    if schema:
        config.attributes["schema"] = schema
    return config


def upgrade(
    project: Path, database_url: str | None = None, revision: str = "head", *, schema: str | None = None
) -> None:
    """The service's migrations up to ``revision`` in one database (or one schema of it)."""
    from alembic import command

    command.upgrade(alembic_config(project, database_url, schema), revision)


def downgrade(
    project: Path, database_url: str | None = None, revision: str = "base", *, schema: str | None = None
) -> None:
    from alembic import command

    command.downgrade(alembic_config(project, database_url, schema), revision)


def check(project: Path, database_url: str | None = None, *, schema: str | None = None) -> None:
    """Raise when the models and the migrations disagree (``alembic check``)."""
    from alembic import command

    command.check(alembic_config(project, database_url, schema))


def migrate(project: Path, container: OutboxContainer, revision: str = "head") -> list[str]:
    """``migrate``: the service's migrations up to ``revision`` in every source, the default
    first; each source keeps its own version table. Returns the sources migrated."""
    from outbox_kit.runtime.sources import plan_sources

    plans = plan_sources(container.settings(), container.modules())
    for plan in plans:
        log.info("migrating source %s", plan.name)
        upgrade(project, plan.database.url, revision, schema=plan.schema)
    return [plan.name for plan in plans]
