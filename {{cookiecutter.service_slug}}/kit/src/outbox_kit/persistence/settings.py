"""Where the outbox, inbox and business tables live: SQLite (aiosqlite) or PostgreSQL (asyncpg),
chosen by the URL, and every time limit of a wait on the database."""

from __future__ import annotations

from pydantic import BaseModel, Field

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
