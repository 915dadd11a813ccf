"""An outage (the database unreachable, the connection gone) says nothing about the data: it is
never charged to a message, and the operation succeeds once the database is back."""

from __future__ import annotations

from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

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
