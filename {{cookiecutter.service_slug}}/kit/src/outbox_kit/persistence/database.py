"""The async engine and session factory for SQLite (aiosqlite) and PostgreSQL (asyncpg).

SQLite runs in WAL mode with a busy timeout, so the API and the worker (one process or two) can
share the embedded file; PostgreSQL gets a normal pool. One ``AsyncSession`` serves one unit of
work or one consumed message and is never shared between tasks.

Every wait on the database is bounded, so a lock held elsewhere or a line gone silent ends in an
error, never in a hang: PostgreSQL cancels a statement past ``statement_timeout`` (lock waits
included), the driver gives up on any answer a little later (``command_timeout``: a rollback or a
close on a silent line too), and connecting and waiting for a pooled connection have their own
limits. SQLite's bound is its busy timeout.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, cast

from sqlalchemy import event, text
from sqlalchemy.engine import make_url
from sqlalchemy.engine.default import DefaultDialect
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, async_sessionmaker, create_async_engine
from sqlalchemy.pool import QueuePool
from sqlmodel.ext.asyncio.session import AsyncSession

from .guard import GuardedSession, guard_engine
from .settings import DatabaseSettings

log = logging.getLogger(__name__)


class Database:
    """Owns the engine; hands out sessions. Built once by the container."""

    def __init__(self, settings: DatabaseSettings) -> None:
        self.settings = settings
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
        return create_async_engine(
            self.url,
            echo=self.settings.echo,
            pool_size=self.settings.pool_size,
            pool_pre_ping=True,
            pool_timeout=self.settings.pool_timeout_seconds,
            connect_args=self._postgres_connect_args({}),
        )

    def _sqlite_pool_limits(self) -> dict[str, Any]:
        """The pool wait limit where SQLite connections are pooled: SQLAlchemy before 2.1 opens a
        file database per use (``NullPool``), which takes no ``pool_timeout``."""
        dialect = cast("type[DefaultDialect]", self.url.get_dialect(_is_async=True))
        pool_class = dialect.get_pool_class(self.url)
        if issubclass(pool_class, QueuePool):
            return {"pool_timeout": self.settings.pool_timeout_seconds}
        return {}

    def _postgres_connect_args(self, server_settings: dict[str, str]) -> dict[str, Any]:
        """asyncpg's time limits (see the module docstring) and ``server_settings``."""
        settings = self.settings
        statement_ms = max(1, int(settings.statement_timeout_seconds * 1000))
        return {
            "timeout": settings.connect_timeout_seconds,
            "command_timeout": settings.client_timeout_seconds,
            "server_settings": {"statement_timeout": f"{statement_ms}ms", **server_settings},
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
