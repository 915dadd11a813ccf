"""A transient database error (deadlock, serialization failure, a busy SQLite) re-runs the whole
operation: a second attempt may not meet the same conflict. Outages are told apart in
``outages``."""

from __future__ import annotations

from sqlalchemy.exc import DBAPIError

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
