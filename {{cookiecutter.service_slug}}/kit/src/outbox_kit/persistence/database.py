"""The database: its settings, the async engine and session factory, and how a failure is told
apart (transient, outage, timeout).

The async engine and session factory for SQLite (aiosqlite) and PostgreSQL (asyncpg). SQLite runs
in WAL mode with a busy timeout, so the API and the worker (one process or two) can share the
embedded file; PostgreSQL gets a normal pool. One ``AsyncSession`` serves one unit of work or one
consumed message and is never shared between tasks. Every session and engine is guarded against a
commit inside a handler (``persistence.save_guard``).

A transient database error (deadlock, serialization failure, a busy SQLite) re-runs the whole
operation: a second attempt may not meet the same conflict. An outage (the database unreachable,
the connection gone) says nothing about the data: it is never charged to a message, and the
operation succeeds once the database is back.

Every wait on the database is bounded, so a lock held elsewhere or a line gone silent ends in an
error, never in a hang: PostgreSQL cancels a statement past ``statement_timeout`` (lock waits
included), the driver gives up on any answer a little later (``command_timeout``: a rollback or a
close on a silent line too), and connecting and waiting for a pooled connection have their own
limits. SQLite's bound is its busy timeout."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, cast

from pydantic import BaseModel, Field
from sqlalchemy import event, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.engine.default import DefaultDialect
from sqlalchemy.exc import DBAPIError, DisconnectionError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, async_sessionmaker, create_async_engine
from sqlalchemy.pool import QueuePool
from sqlmodel.ext.asyncio.session import AsyncSession

from outbox_kit.persistence.save_guard import GuardedSession, guard_engine

# -- settings ----------------------------------------------------------------------------------------
# Where the outbox, inbox and business tables live: SQLite (aiosqlite) or PostgreSQL (asyncpg),
# chosen by the URL, and every time limit of a wait on the database.


# What the driver's own bound adds to the server's statement timeout (see ``client_timeout_seconds``).
CLIENT_TIMEOUT_MARGIN_SECONDS = 2.0


class DatabaseSettings(BaseModel):
    """SQLite (aiosqlite) or PostgreSQL (asyncpg), chosen by the URL."""

    url: str = "sqlite+aiosqlite:///./service.db"
    echo: bool = False
    pool_size: int = Field(default=10, ge=1)
    sqlite_busy_timeout_ms: int = Field(default=10_000, ge=0)
    transient_retry_attempts: int = Field(default=3, ge=1)
    # PostgreSQL ends a processor's own transaction (claim, renewal, stamp, release: each takes
    # milliseconds) left idle this long: a process frozen inside one (a paused VM, a debugger)
    # would otherwise keep its rows locked, and no worker could take them, lease over or not.
    bookkeeping_idle_timeout_seconds: float = Field(default=60.0, gt=0)
    # Every wait on the database has an end, so no request, delivery or shutdown waits for ever
    # on a lock held elsewhere or on a line that went silent (packets dropped, not refused).
    statement_timeout_seconds: float = Field(
        default=10.0, gt=0, description="PostgreSQL cancels a statement running longer (lock waits included)"
    )
    connect_timeout_seconds: float = Field(default=5.0, gt=0, description="Opening one connection")
    pool_timeout_seconds: float = Field(default=10.0, gt=0, description="Waiting for a pooled connection")

    @property
    def client_timeout_seconds(self) -> float:
        """How long the driver waits for any answer (a statement, a rollback, a close): a little
        longer than the server's statement timeout, so on a live line the server cancels first
        (a clean error, the transaction rolled back) and the client bound only ends a silent one."""
        return self.statement_timeout_seconds + CLIENT_TIMEOUT_MARGIN_SECONDS

    @property
    def is_postgresql(self) -> bool:
        return self.url.startswith("postgresql")


# Serialization failure, deadlock, lock not available (PostgreSQL), busy/locked (SQLite).
TRANSIENT_SQLSTATES = frozenset({"40001", "40P01", "55P03"})

TRANSIENT_MESSAGES = ("database is locked", "database is busy", "database table is locked")


def is_transient(error: BaseException) -> bool:
    """True for database errors that a re-run of the whole operation may not hit again."""
    if not isinstance(error, DBAPIError):
        return False
    if getattr(error.orig, "sqlstate", None) in TRANSIENT_SQLSTATES:
        return True
    text_ = str(error.orig).lower()
    return any(message in text_ for message in TRANSIENT_MESSAGES)


# Connection exceptions (class 08), shutting down, cannot connect now, too many connections.
OUTAGE_SQLSTATES = frozenset({"57P01", "57P02", "57P03", "53300"})

DRIVER_PACKAGES = ("sqlalchemy", "asyncpg", "aiosqlite", "sqlite3")

# Query canceled: PostgreSQL ended a statement at ``DATABASE__STATEMENT_TIMEOUT_SECONDS``.
STATEMENT_TIMEOUT_SQLSTATE = "57014"


def is_database_outage(error: BaseException) -> bool:
    """True when the database could not be reached or dropped the connection: the operation
    says nothing about the data and succeeds once the database is back.

    A refused connect comes out of asyncpg as a bare ``ConnectionRefusedError``, the same type a
    handler's own HTTP call raises; only the traceback tells them apart, so a plain socket error
    counts only when it was raised inside the database driver."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, DBAPIError):
            if current.connection_invalidated:
                return True
            sqlstate = str(getattr(current.orig, "sqlstate", "") or "")
            if sqlstate.startswith("08") or sqlstate in OUTAGE_SQLSTATES:
                return True
        elif type(current).__module__.partition(".")[0] == "asyncpg" and type(current).__name__ in {
            "ConnectionDoesNotExistError",
            "CannotConnectNowError",
            "ConnectionFailureError",
        }:
            return True
        elif isinstance(current, OSError) and _raised_in_driver(current):
            return True  # refused, reset, unreachable, timed out: inside the driver
        current = current.__cause__ or current.__context__
    return False


def _raised_in_driver(error: BaseException) -> bool:
    frame = error.__traceback__
    while frame is not None:
        module = str(frame.tb_frame.f_globals.get("__name__", ""))
        if module.partition(".")[0] in DRIVER_PACKAGES:
            return True
        frame = frame.tb_next
    return False


def is_database_timeout(error: BaseException) -> bool:
    """True when the database did not answer in time: a statement ended by the statement timeout
    (a lock held elsewhere, an overloaded server) or no pooled connection within the pool
    timeout. (The driver's own timeout on a silent line is an outage: see above.) Nothing was
    changed; the same operation may succeed a moment later."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, PoolTimeoutError):
            return True
        sqlstate = getattr(current.orig, "sqlstate", None) if isinstance(current, DBAPIError) else None
        if sqlstate == STATEMENT_TIMEOUT_SQLSTATE:
            return True
        current = current.__cause__ or current.__context__
    return False


log = logging.getLogger(__name__)


# The isolation every PostgreSQL transaction of the service runs at (see ``_postgres_connect_args``).
READ_COMMITTED = "read committed"

# A pooled connection idle longer than this is pinged before it is handed out (see below).
PING_AFTER_IDLE_SECONDS = 2.0


def ping_when_idle(engine: Engine) -> None:
    """Ping a pooled connection before use only when it sat idle for ``PING_AFTER_IDLE_SECONDS``.

    SQLAlchemy's ``pool_pre_ping`` pings on every checkout: a round trip per unit of work, per
    consumed message and per commit, and the largest single cost of a one-event commit. A
    connection used a moment ago is alive unless the server went away in that moment, and then
    the request that meets the dead connection fails and SQLAlchemy discards the whole pool (every
    later checkout gets a fresh connection). A connection that sat idle, the one a restart or a
    failover between two requests leaves behind, is pinged, and replaced if the ping fails, as
    pre-ping did."""

    @event.listens_for(engine, "checkin")
    def _idle_from(_dbapi_connection: Any, record: Any) -> None:  # noqa: ANN401 (the driver's)
        record.info[IDLE_SINCE] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _ping_if_idle(dbapi_connection: Any, record: Any, _proxy: object) -> None:  # noqa: ANN401
        idle_since = record.info.get(IDLE_SINCE)
        if idle_since is None or time.monotonic() - idle_since < PING_AFTER_IDLE_SECONDS:
            return
        try:
            dbapi_connection.ping()
        except Exception as error:
            raise DisconnectionError(str(error)) from error  # the pool connects a fresh one


IDLE_SINCE = "outbox_kit.idle_since"


class Database:
    """Owns the engine; hands out sessions. Built once per source by the container.

    ``schema`` (PostgreSQL) puts every table of this database object in that schema: each
    connection's ``search_path`` is the schema alone, so the same table definitions, statements
    and migrations serve a source kept in a schema of its own."""

    def __init__(self, settings: DatabaseSettings, *, schema: str | None = None) -> None:
        self.settings = settings
        self.schema = schema
        self.url = make_url(settings.url)
        self.engine: AsyncEngine = self._create_engine()
        self.sessions = async_sessionmaker(
            self.engine,
            class_=AsyncSession,
            sync_session_class=GuardedSession,
            expire_on_commit=False,
            autoflush=False,
        )
        self.bookkeeping_engine = self._create_bookkeeping_engine()
        for engine in {self.engine, self.bookkeeping_engine}:
            guard_engine(engine.sync_engine)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    @property
    def is_postgresql(self) -> bool:
        return self.dialect == "postgresql"

    def _create_engine(self) -> AsyncEngine:
        if self.url.get_backend_name() == "sqlite":
            database = self.url.database
            if database and database != ":memory:":
                Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)
            engine = create_async_engine(
                self.url,
                echo=self.settings.echo,
                connect_args={"timeout": self.settings.sqlite_busy_timeout_ms / 1000},
                **self._sqlite_pool_limits(),
            )
            busy_ms = self.settings.sqlite_busy_timeout_ms

            @event.listens_for(engine.sync_engine, "connect")
            def _sqlite_pragmas(dbapi_connection: Any, _record: object) -> None:  # noqa: ANN401
                cursor = dbapi_connection.cursor()
                cursor.execute("PRAGMA journal_mode=WAL")
                cursor.execute(f"PRAGMA busy_timeout={int(busy_ms)}")
                cursor.execute("PRAGMA foreign_keys=ON")
                cursor.execute("PRAGMA synchronous=NORMAL")
                cursor.close()

            return engine
        engine = create_async_engine(
            self.url,
            echo=self.settings.echo,
            pool_size=self.settings.pool_size,
            pool_timeout=self.settings.pool_timeout_seconds,
            connect_args=self._postgres_connect_args({}),
        )
        ping_when_idle(engine.sync_engine)
        return engine

    def _sqlite_pool_limits(self) -> dict[str, Any]:
        """The pool wait limit where SQLite connections are pooled: SQLAlchemy before 2.1 opens a
        file database per use (``NullPool``), which takes no ``pool_timeout``."""
        dialect = cast("type[DefaultDialect]", self.url.get_dialect(_is_async=True))
        pool_class = dialect.get_pool_class(self.url)
        if issubclass(pool_class, QueuePool):
            return {"pool_timeout": self.settings.pool_timeout_seconds}
        return {}

    def _postgres_connect_args(self, server_settings: dict[str, str]) -> dict[str, Any]:
        """asyncpg's time limits (see the module docstring), the isolation level and
        ``server_settings``.

        Every transaction runs READ COMMITTED, set here rather than assumed from the server:
        the claim's key guard, the replay gate and the inbox rely on each statement seeing what
        committed before it began, and on an update re-checking a row another transaction just
        changed. Under a server or database whose default is REPEATABLE READ, a claim racing a
        replay would fail with a serialization error instead. A connection startup setting
        covers every statement of the connection (ORM sessions, the bookkeeping transactions and
        the autocommit statements alike) at no extra round trip."""
        settings = self.settings
        statement_ms = max(1, int(settings.statement_timeout_seconds * 1000))
        if self.schema is not None:
            server_settings = {"search_path": self.schema, **server_settings}
        return {
            "timeout": settings.connect_timeout_seconds,
            "command_timeout": settings.client_timeout_seconds,
            "server_settings": {
                "statement_timeout": f"{statement_ms}ms",
                "default_transaction_isolation": READ_COMMITTED,
                **server_settings,
            },
        }

    def _create_bookkeeping_engine(self) -> AsyncEngine:
        """The processors' own writes (claims, lease renewals, stamps, releases).

        On PostgreSQL they commit without waiting for the WAL flush (``synchronous_commit =
        off``): a database crash can lose the last few of them, which only means a row is
        delivered again (at-least-once; consumers deduplicate). Business writes, handler
        effects and the stamps committed with them keep the normal, durable commit.
        A transaction of theirs left idle for ``DATABASE__BOOKKEEPING_IDLE_TIMEOUT_SECONDS`` is
        ended by the server, so a frozen process cannot hold its rows' locks for ever.
        """
        if self.url.get_backend_name() != "postgresql":
            return self.engine
        idle_ms = max(1, int(self.settings.bookkeeping_idle_timeout_seconds * 1000))
        return create_async_engine(
            self.url,
            echo=self.settings.echo,
            pool_size=self.settings.pool_size,
            # No pre-ping per checkout (a round trip per transaction on the hot path): a dead
            # connection fails the cycle, which the polling loop retries.
            pool_recycle=300,
            pool_timeout=self.settings.pool_timeout_seconds,
            connect_args=self._postgres_connect_args(
                {"synchronous_commit": "off", "idle_in_transaction_session_timeout": f"{idle_ms}ms"}
            ),
        )

    @asynccontextmanager
    async def session(self) -> AsyncIterator[AsyncSession]:
        async with self.sessions() as session:
            yield session

    @asynccontextmanager
    async def bookkeeping(self) -> AsyncIterator[AsyncConnection]:
        """One short transaction of a processor's own bookkeeping (Core, no ORM session;
        see ``_create_bookkeeping_engine``). Commits on exit."""
        async with self.bookkeeping_engine.begin() as connection:
            yield connection

    @asynccontextmanager
    async def bookkeeping_statement(self) -> AsyncIterator[AsyncConnection]:
        """One bookkeeping statement that needs no transaction around it (a renewal, a group of
        stamps: each is atomic on its own; not the claim, which holds the replay gate). On
        PostgreSQL it runs in autocommit, one round trip instead of BEGIN, statement, COMMIT; on
        SQLite it is ``bookkeeping()``, whose transaction is what serializes the writers there."""
        if not self.is_postgresql:
            async with self.bookkeeping() as connection:
                yield connection
            return
        async with self.bookkeeping_engine.connect() as connection:
            yield await connection.execution_options(isolation_level="AUTOCOMMIT")

    async def ping(self) -> None:
        """Raise unless the database answers (used by /readyz)."""
        async with self.engine.connect() as connection:
            await connection.execute(text("SELECT 1"))

    async def dispose(self) -> None:
        await self.engine.dispose()
        if self.bookkeeping_engine is not self.engine:
            await self.bookkeeping_engine.dispose()
