"""Which database errors ``uow.run`` re-runs an operation for, and which ones mean the database
is unreachable (a consumer holds its message instead of charging it an attempt)."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from outbox_kit.persistence.database import is_database_outage, is_transient
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError
from sqlalchemy.ext.asyncio import create_async_engine

pytestmark = pytest.mark.unit


class DriverError(Exception):
    """What asyncpg's adapter hands SQLAlchemy: an exception carrying the SQLSTATE."""

    def __init__(self, message: str, sqlstate: str | None = None) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


@pytest.mark.parametrize(
    ("error", "transient"),
    [
        (OperationalError("UPDATE", {}, DriverError("could not serialize access", "40001")), True),
        (OperationalError("UPDATE", {}, DriverError("deadlock detected", "40P01")), True),
        (OperationalError("SELECT", {}, DriverError("could not obtain lock", "55P03")), True),
        (OperationalError("COMMIT", {}, DriverError("database is locked")), True),
        (OperationalError("COMMIT", {}, DriverError("Database is BUSY")), True),
        (IntegrityError("INSERT", {}, DriverError("duplicate key value", "23505")), False),
        (DBAPIError("SELECT", {}, DriverError("syntax error", "42601")), False),
        (RuntimeError("database is locked"), False),  # not a database error at all
    ],
)
def test_only_retryable_database_errors_are_transient(error: BaseException, transient: bool) -> None:
    assert is_transient(error) is transient


def _caused_by(error: BaseException, cause: BaseException) -> BaseException:
    error.__cause__ = cause
    return error


@pytest.mark.parametrize(
    ("error", "outage"),
    [
        (OperationalError("SELECT", {}, DriverError("terminating connection", "57P01")), True),
        (OperationalError("SELECT", {}, DriverError("connection failure", "08006")), True),
        (DBAPIError("SELECT", {}, DriverError("closed"), connection_invalidated=True), True),
        (OperationalError("UPDATE", {}, DriverError("deadlock detected", "40P01")), False),
        (IntegrityError("INSERT", {}, DriverError("duplicate key value", "23505")), False),
        # The same types a handler's own HTTP call raises: not the database's.
        (ConnectionRefusedError(111, "Connect call failed"), False),
        (TimeoutError("the payment API did not answer"), False),
        (_caused_by(RuntimeError("handler gave up"), OSError(104, "Connection reset by peer")), False),
        (ValueError("bad payload"), False),
    ],
)
def test_only_an_unreachable_database_is_an_outage(error: BaseException, outage: bool) -> None:
    """An outage holds a consumed message uncharged; anything else is the message's own failure."""
    assert is_database_outage(error) is outage


async def test_a_refused_database_connect_is_an_outage() -> None:
    """asyncpg raises a bare ``ConnectionRefusedError`` for a database that is down; raised
    inside the driver, it is an outage (and wrapped in a handler's error, still one)."""
    engine = create_async_engine("postgresql+asyncpg://nobody@127.0.0.1:1/none")
    try:
        with pytest.raises(ConnectionRefusedError) as refused:
            async with engine.connect() as connection:
                await connection.execute(sa.text("SELECT 1"))
    finally:
        await engine.dispose()
    assert is_database_outage(refused.value)
    assert is_database_outage(_caused_by(RuntimeError("could not load the order"), refused.value))
