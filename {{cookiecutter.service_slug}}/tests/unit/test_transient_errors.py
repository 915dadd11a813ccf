"""Which database errors ``uow.run`` re-runs an operation for."""

from __future__ import annotations

import pytest
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError

from {{ cookiecutter.package_name }}.building_blocks.persistence.database import (
    is_transient,
)

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
