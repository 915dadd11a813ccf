"""The pytest fixtures and helpers every suite of a service shares, and the kit's own suite: a
plugin, loaded before any ``conftest.py`` with ``-p outbox_kit.testing.fixtures`` in the suite's
pytest ``addopts`` (so its helpers can be imported by a conftest; it needs pytest, which the kit
does not install).

Services. Tests that need PostgreSQL or a broker carry a marker (``postgres``, ``rabbitmq``,
``kafka``, ``nats``, ``redis``). When the service does not answer, they are skipped with the
reason, or fail when ``REQUIRE_SERVICES=1`` (CI). Addresses come from ``TEST_POSTGRES_URL``,
``TEST_RABBITMQ_URL``, ``TEST_KAFKA_URL`` (``host:port``, as ``MESSAGE_BUS__URL`` takes it),
``TEST_NATS_URL`` and ``TEST_REDIS_URL``.

Isolation. Every test gets its own database: a copy of a prepared SQLite file, or a fresh
PostgreSQL database per test session whose tables are emptied before each test. Broker names
get a namespace unique to the test, so runs never see each other's messages.

Hermeticity. Settings are built explicitly; the environment's settings variables and ``.env``
are ignored, so a developer's local configuration cannot change a test's outcome.

What a suite adapts, by overriding a fixture in its ``conftest.py``: ``migrate_database`` (how a
fresh database gets its tables: the kit's models here, a service's migrations there) and
``container_builder`` (the kit's container with no contexts here, a service's
``build_container`` there)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Generator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any, TypeVar, cast
from urllib.parse import urlparse

import pytest
import sqlalchemy as sa
from dependency_injector import providers
from fastapi import APIRouter
from sqlalchemy.ext.asyncio import create_async_engine
from sqlmodel import SQLModel

import outbox_kit.persistence.tables  # noqa: F401  (the kit's tables, in SQLModel's metadata)
from outbox_kit.application.context import (
    RequestContext,
    use_context,
)
from outbox_kit.processor.settings import LEASE_MARGIN_FRACTION
from outbox_kit.runtime.container import OutboxContainer
from outbox_kit.runtime.settings import ServiceSettings

# The kit's test modules a suite imports (the reliability tier): pytest rewrites their asserts as
# it does a test file's, so a failure shows the values, not a bare AssertionError.
pytest.register_assert_rewrite(
    "outbox_kit.testing.reliability", "outbox_kit.testing.processes", "outbox_kit.testing.protocol_model"
)

REQUIRE_SERVICES = os.environ.get("REQUIRE_SERVICES") == "1"
SERVICE_URLS = {
    "postgres": os.environ.get("TEST_POSTGRES_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"),
    "rabbitmq": os.environ.get("TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/"),
    "kafka": os.environ.get("TEST_KAFKA_URL", "127.0.0.1:9092"),
    "nats": os.environ.get("TEST_NATS_URL", "nats://127.0.0.1:4222"),
    "redis": os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379"),
}
T = TypeVar("T")
SettingsT = TypeVar("SettingsT", bound=ServiceSettings)
DEFAULT_PORTS = {"postgres": 5432, "rabbitmq": 5672, "kafka": 9092, "nats": 4222, "redis": 6379}
_reachable: dict[str, bool] = {}


def service_reachable(name: str) -> bool:
    if name not in _reachable:
        address = SERVICE_URLS[name].replace("postgresql+asyncpg", "postgresql")
        # Kafka's address is a bootstrap list, ``host:port[,host:port]``: try the first.
        url = urlparse(address if "://" in address else f"//{address.split(',')[0]}")
        try:
            with socket.create_connection(
                (url.hostname or "127.0.0.1", url.port or DEFAULT_PORTS[name]), 1.0
            ):
                _reachable[name] = True
        except OSError:
            _reachable[name] = False
    return _reachable[name]


# How to start each one on a laptop with Docker (CI has them running).
START_COMMANDS = {
    "postgres": "docker run -d -p 5432:5432 -e POSTGRES_HOST_AUTH_METHOD=trust postgres:16",
    "rabbitmq": "docker run -d -p 5672:5672 rabbitmq:3.13",
    "kafka": "docker run -d -p 9092:9092 apache/kafka:3.8.0",
    "nats": "docker run -d -p 4222:4222 nats:2.10 -js",
    "redis": "docker run -d -p 6379:6379 redis:7",
}
UNREACHABLE = " is not reachable at "


def require_service(name: str) -> None:
    """Skip the test (with the reason) when ``name`` does not answer; fail under
    ``REQUIRE_SERVICES=1``, where a missing service is a broken machine, not a laptop."""
    if service_reachable(name):
        return
    message = f"{name}{UNREACHABLE}{SERVICE_URLS[name]}"
    if REQUIRE_SERVICES:
        pytest.fail(f"{message} and REQUIRE_SERVICES=1")
    pytest.skip(f"{message}: start it ({START_COMMANDS[name]}) or set TEST_{name.upper()}_URL")


def pytest_configure(config: pytest.Config) -> None:
    """Hermeticity: the settings variables of the shell running the tests (``DATABASE__URL``,
    ``ENVIRONMENT``...) are forgotten before any test builds settings. Only in a test run: a
    process a test starts (``outbox_kit.testing.processes``) reads the variables it is given."""
    del config
    sections = tuple(f"{name.upper()}__" for name in ServiceSettings.model_fields)
    for name in list(os.environ):
        if name == "ENVIRONMENT" or name.startswith(sections):
            del os.environ[name]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Every skip for one missing service gets the same location, so the summary folds them into
    one line per service ("SKIPPED [43] .../testing/fixtures.py: rabbitmq is not reachable at ...")
    instead of a line per test."""
    del item, call
    report: pytest.TestReport = yield
    longrepr = report.longrepr
    if report.skipped and isinstance(longrepr, tuple) and UNREACHABLE in str(longrepr[2]):
        report.longrepr = (__file__, require_service.__code__.co_firstlineno, longrepr[2])
    return report


@pytest.fixture(autouse=True)
def _services_available(request: pytest.FixtureRequest) -> None:
    for name in SERVICE_URLS:
        if request.node.get_closest_marker(name) is not None:
            require_service(name)


# -- databases -------------------------------------------------------------------------------


def in_thread(function: Callable[..., T], *args: object) -> T:
    """Run blocking set-up code (Alembic's env, ``asyncio.run``) on a thread of its own, so it
    never touches the event loop the tests share."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        result: T = pool.submit(function, *args).result()
        return result


def run_async(coroutine: Coroutine[Any, Any, T]) -> T:
    result: T = in_thread(asyncio.run, coroutine)
    return result


async def _create_tables(url: str) -> None:
    engine = create_async_engine(url)
    try:
        async with engine.begin() as connection:
            await connection.run_sync(SQLModel.metadata.create_all)
    finally:
        await engine.dispose()


def create_tables(url: str) -> None:
    """Create every table SQLModel knows (the kit's, and any imported) on ``url``."""
    run_async(_create_tables(url))


@pytest.fixture(scope="session")
def migrate_database() -> Callable[[str], None]:
    """How a fresh database gets its tables: the kit's models. A service overrides it with its
    migrations."""
    return create_tables


@pytest.fixture(scope="session")
def sqlite_template(
    tmp_path_factory: pytest.TempPathFactory, migrate_database: Callable[[str], None]
) -> Path:
    """A prepared SQLite file, copied for every test that needs a fresh database."""
    path = tmp_path_factory.mktemp("sqlite-template") / "template.db"
    migrate_database(f"sqlite+aiosqlite:///{path}")
    return path


async def _admin(statement: str) -> None:
    engine = create_async_engine(SERVICE_URLS["postgres"], isolation_level="AUTOCOMMIT")
    try:
        async with engine.connect() as connection:
            await connection.execute(sa.text(statement))
    finally:
        await engine.dispose()


def create_postgres_database() -> str:
    """A new, empty PostgreSQL database (not migrated); returns its URL."""
    name = f"test_{uuid.uuid4().hex[:12]}"
    run_async(_admin(f'CREATE DATABASE "{name}"'))
    # Throwaway test data: skip the fsync per commit (PostgreSQL's crash durability is not
    # what these tests are about, and the reliability tier commits thousands of times).
    run_async(_admin(f'ALTER DATABASE "{name}" SET synchronous_commit = off'))
    return SERVICE_URLS["postgres"].rsplit("/", 1)[0] + f"/{name}"


def drop_postgres_database(url: str) -> None:
    run_async(_admin(f'DROP DATABASE IF EXISTS "{url.rsplit("/", 1)[1]}" WITH (FORCE)'))


@pytest.fixture(scope="session")
def postgres_database(migrate_database: Callable[[str], None]) -> Iterator[str]:
    """One fresh PostgreSQL database for the session, prepared; dropped at the end."""
    require_service("postgres")  # session fixtures run before the autouse check above
    url = create_postgres_database()
    migrate_database(url)
    yield url
    drop_postgres_database(url)


async def _truncate(url: str) -> None:
    tables = ", ".join(f'"{t.name}"' for t in SQLModel.metadata.sorted_tables)
    engine = create_async_engine(url)
    try:
        async with engine.begin() as connection:
            await connection.execute(sa.text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
    finally:
        await engine.dispose()


def fresh_sqlite(tmp_path: Path, template: Path) -> str:
    path = tmp_path / "service.db"
    shutil.copyfile(template, path)
    return f"sqlite+aiosqlite:///{path}"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, migrated database: every test using it runs on SQLite and on PostgreSQL."""
    if request.param == "sqlite":
        return fresh_sqlite(tmp_path, request.getfixturevalue("sqlite_template"))
    url: str = request.getfixturevalue("postgres_database")
    run_async(_truncate(url))
    return url


@pytest.fixture
def sqlite_url(tmp_path: Path, sqlite_template: Path) -> str:
    return fresh_sqlite(tmp_path, sqlite_template)


@pytest.fixture
def postgres_url(postgres_database: str) -> str:
    run_async(_truncate(postgres_database))
    return postgres_database


# -- settings and containers ----------------------------------------------------------------

TEST_SIGNING_KEYS = {"test": "test-signing-secret"}


def make_settings(database_url: str, **sections: dict[str, Any]) -> ServiceSettings:
    """Settings for a test: outbox and inbox on, signed headers, quick timings, a namespace of
    its own; ``sections`` override any section's values."""
    return settings_of(ServiceSettings, database_url, **sections)


def settings_of(settings_type: type[SettingsT], database_url: str, **sections: dict[str, Any]) -> SettingsT:
    """:func:`make_settings` as a service's ``Settings``, where its own defaults matter (its
    slug)."""
    values: dict[str, dict[str, Any]] = {
        "application": {"namespace": f"t{uuid.uuid4().hex[:10]}", "instance_id": "test-processor"},
        "database": {"url": database_url},
        "message_bus": {
            "enable_outbox": True,
            "enable_inbox": True,
            "signing_keys": TEST_SIGNING_KEYS,
            "signing_key_id": "test",
            # The shortest Apache Kafka allows: a new consumer group's first join is quicker on a
            # broker that holds it for part of the session (tansu: half).
            "kafka_session_timeout_seconds": 6.0,
        },
        "outbox": {"polling_interval_seconds": 0.2, "cleanup_interval_seconds": 3600},
        "logging": {"level": "WARNING"},
    }
    for section, overrides in sections.items():
        values[section] = {**values.get(section, {}), **overrides}
    # Time limits a test leaves unset follow its lease and delivery limit (runtime.time_limits).
    return settings_type(_env_file=None, **cast("dict[str, Any]", values))


def longest_delivery(lease_seconds: float) -> float:
    """The longest delivery time limit a lease admits (OUTBOX__DELIVERY_TIMEOUT_SECONDS): for
    tests that shorten the lease; give the publish limit less than this (it must end first)."""
    return lease_seconds * (1 - LEASE_MARGIN_FRACTION)


def kit_container(settings: ServiceSettings) -> OutboxContainer:
    """The kit's container on ``settings``, with no contexts (a test installs the harness's)."""
    return OutboxContainer(settings=providers.Object(settings), modules=providers.Object([]))


@pytest.fixture(scope="session")
def container_builder() -> Callable[[ServiceSettings], OutboxContainer]:
    """How ``make_container`` builds a container from a test's settings: the kit's own. A
    service overrides it with its ``build_container``."""
    return kit_container


ContainerFactory = Callable[..., OutboxContainer]
ContainerBuilder = Callable[[ServiceSettings], OutboxContainer]
# How a process of the test's own (``outbox_kit.testing.processes``) finds the suite's container.
CONTAINER_VARIABLE = "OUTBOX_KIT_TEST_CONTAINER"


def builder_path(build: ContainerBuilder) -> str:
    """``module:function`` of a container builder, for a process to import it by."""
    return f"{build.__module__}:{build.__qualname__}"


def service_container(settings: ServiceSettings) -> OutboxContainer:
    """In a test's process: the container ``OUTBOX_KIT_TEST_CONTAINER`` names (the kit's own
    when it is unset), on ``settings``."""
    module, _, name = os.environ.get(CONTAINER_VARIABLE, f"{__name__}:kit_container").partition(":")
    build: ContainerBuilder = getattr(importlib.import_module(module), name)
    return build(settings)


@pytest.fixture
async def make_container(
    database_url: str, container_builder: Callable[[ServiceSettings], OutboxContainer]
) -> AsyncIterator[ContainerFactory]:
    """Build containers on the test's database; their engines are disposed afterwards."""
    built: list[OutboxContainer] = []

    def factory(**sections: dict[str, Any]) -> OutboxContainer:
        container = container_builder(make_settings(database_url, **sections))
        built.append(container)
        return container

    yield factory
    for container in built:
        await container.data_sources().dispose()


@pytest.fixture
async def container(make_container: ContainerFactory) -> OutboxContainer:
    return make_container()


@contextmanager
def acting_as(
    tenant: str = "acme",
    user: str = "alice",
    roles: tuple[str, ...] = ("clerk",),
    correlation_id: str = "corr-1",
) -> Iterator[RequestContext]:
    """Run a block as a given caller (what the API middleware does for a request)."""
    context = RequestContext(
        tenant_id=tenant,
        user_id=user,
        roles=roles,
        correlation_id=correlation_id,
        traceparent="00-" + "a" * 32 + "-" + "b" * 16 + "-01",
        authentication_type="test",
    )
    with use_context(context) as active:
        yield active


async def fetch(container: OutboxContainer, statement: Any) -> list[Any]:
    """Rows of ``statement`` read in a fresh session."""
    async with container.database().session() as session:
        return list((await session.exec(statement)).all())


async def eventually(check: Callable[[], bool], timeout: float = 20.0) -> None:  # noqa: ASYNC109 (a deadline)
    """Wait until ``check()`` holds, polling every 20 ms; fail after ``timeout`` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            msg = "condition not met in time"
            raise AssertionError(msg)
        await asyncio.sleep(0.02)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- servers and processes -------------------------------------------------------------------


@asynccontextmanager
async def live_server(
    container: OutboxContainer, *, with_worker: bool = True, routers: Sequence[APIRouter] = ()
) -> AsyncIterator[str]:
    """The app on a real uvicorn server (lifespan included), on a free port of this loop, with
    the configuration ``run`` and ``api`` serve with (time limits for slow clients included);
    ``routers`` stand for a context a user adds later (the app's edge must cover it too)."""
    import uvicorn  # noqa: PLC0415 (only the suites that serve need it)

    from outbox_kit.runtime.app import create_app  # noqa: PLC0415
    from outbox_kit.runtime.server import server_config  # noqa: PLC0415

    app = create_app(container, with_worker=with_worker)
    for router in routers:
        app.include_router(router)
    settings = container.settings()
    config = server_config(app, settings.api, settings.logging.level)
    config.host, config.port = "127.0.0.1", free_port()
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        for _ in range(200):
            if server.started:
                break
            if task.done():
                task.result()
            await asyncio.sleep(0.05)
        yield f"http://127.0.0.1:{config.port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 20)


def token_for(
    container: OutboxContainer, tenant: str = "acme", user: str = "alice", roles: tuple[str, ...] = ()
) -> str:
    """A bearer token the container's API accepts."""
    return container.tokens().mint(user_id=user, tenant_id=tenant, roles=roles)


def service_argv(*arguments: str, package: str | None = None) -> list[str]:
    """A service's command line with ``arguments``, as a process: ``python -m <package> ...``,
    or, without a package, the kit's own service (``python -m outbox_kit.testing.processes
    service ...``: ``outbox_kit.runtime.cli`` on the kit's container), which the kit's suite
    tests the commands on."""
    if package is not None:
        return [sys.executable, "-m", package, *arguments]
    return [sys.executable, "-m", "outbox_kit.testing.processes", "service", *arguments]


def service_env(database_url: str, **extra: str) -> dict[str, str]:
    """A service process's environment: none of the test's settings variables; the database,
    INFO logs, and what :func:`make_settings` gives a test (outbox and inbox on, signed
    headers, Kafka's shortest session); then ``extra``."""
    clean = {k: v for k, v in os.environ.items() if "__" not in k}
    ((key_id, secret),) = TEST_SIGNING_KEYS.items()
    return (
        clean
        | {
            "DATABASE__URL": database_url,
            "LOGGING__LEVEL": "INFO",
            "MESSAGE_BUS__ENABLE_OUTBOX": "true",
            "MESSAGE_BUS__ENABLE_INBOX": "true",
            "MESSAGE_BUS__SIGNING_KEYS": f"{key_id}:{secret}",
            "MESSAGE_BUS__SIGNING_KEY_ID": key_id,
            "MESSAGE_BUS__KAFKA_SESSION_TIMEOUT_SECONDS": "6",
        }
        | extra
    )


@contextmanager
def service_process(
    database_url: str, *arguments: str, package: str | None = None, **env: str
) -> Iterator[subprocess.Popen[str]]:
    """:func:`service_argv` as a real process (stderr readable), stopped with SIGTERM on exit
    (killed if it does not stop within 30 s)."""
    process = subprocess.Popen(  # noqa: S603 (this interpreter, the test's own arguments)
        service_argv(*arguments, package=package),
        env=service_env(database_url, **env),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if process.stderr is not None:
            process.stderr.close()


def get(url: str) -> tuple[int, str]:
    """``GET url``: status and body (an error status too)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 (a loopback URL)
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def wait_for(url: str, process: subprocess.Popen[str], timeout: float = 60) -> None:
    """Wait until ``url`` answers; fail when ``process`` exits first or after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            stderr = process.stderr.read() if process.stderr is not None else ""
            msg = f"the process exited with {process.returncode}: {stderr}"
            raise AssertionError(msg)
        try:
            get(url)
        except OSError:
            time.sleep(0.1)
            continue
        return
    msg = f"{url} did not answer within {timeout} s"
    raise AssertionError(msg)


async def until_answering(url: str, process: subprocess.Popen[str], timeout: float = 60) -> None:  # noqa: ASYNC109
    """Wait (without blocking this loop, which may run a proxy) until ``url`` answers 200; fail
    when ``process`` exits first or after ``timeout`` seconds."""
    import httpx  # noqa: PLC0415 (only the suites that serve need it)

    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=5) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                stderr = process.stderr.read() if process.stderr is not None else ""
                msg = f"exited with {process.returncode}: {stderr}"
                raise AssertionError(msg)
            try:
                if (await client.get(url)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
    msg = f"{url} did not answer 200 within {timeout} s"
    raise AssertionError(msg)


def tansu_binary() -> str | None:
    """The Kafka-protocol broker a test starts of its own: ``TANSU_BIN``, else ``tansu`` on the PATH."""
    return os.environ.get("TANSU_BIN") or shutil.which("tansu")


@contextmanager
def kafka_broker_of_its_own(
    home: Path, *, advertised_port: int | None = None, schemas: str | None = None
) -> Iterator[int]:
    """A Kafka-protocol broker (tansu, in memory) of the test's own, for what the shared one
    cannot do; yields the port it listens on, its log in ``home``. ``advertised_port``: the
    address it gives clients (a proxy's, which Kafka clients then follow) instead of its own.
    ``schemas``: a folder in ``home`` of ``<topic>.json`` JSON schemas (``{"properties":
    {"key": ..., "value": ...}}``) that the broker checks each produced record against, read at
    each produce: writing or removing one takes effect at once. Skipped without a tansu (failed
    under ``REQUIRE_SERVICES=1``)."""
    binary = tansu_binary()
    if binary is None:
        message = "no Kafka-protocol broker of the test's own (set TANSU_BIN)"
        if REQUIRE_SERVICES:
            pytest.fail(f"{message} and REQUIRE_SERVICES=1")
        pytest.skip(message)
    port = free_port()
    options = ["--schema-registry", f"file://./{schemas}"] if schemas else []  # read from cwd
    log = home / "tansu.log"
    with log.open("w") as output:
        broker = subprocess.Popen(  # noqa: S603 (the test's own broker binary and arguments)
            [
                binary,
                "broker",
                "--listener-url",
                f"tcp://127.0.0.1:{port}",
                "--advertised-listener-url",
                f"tcp://127.0.0.1:{advertised_port or port}",
                "--storage-engine",
                "memory://tansu/",
                *options,
            ],
            cwd=home,
            stdout=output,
            stderr=output,
        )
    try:
        _listening(port, broker, log)
        yield port
    finally:
        broker.terminate()
        broker.wait(timeout=30)


def _listening(port: int, broker: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if broker.poll() is not None:
            raise AssertionError(log.read_text())
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        time.sleep(0.1)
    msg = f"the Kafka-protocol broker did not listen in 30 s: {log.read_text()}"
    raise AssertionError(msg)


def plain_dsn(url: str) -> str:
    """A SQLAlchemy PostgreSQL URL as asyncpg and libpq take it (no driver name)."""
    return sa.engine.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
