"""``INSERT ... ON CONFLICT`` on PostgreSQL and SQLite alike.

"Create the row, or change the one that is there" and "create the row unless it is there" are
races when written as a read followed by a write: two transactions read the same state and both
act on it (a lost update, or a unique violation). One ``INSERT ... ON CONFLICT`` statement is
atomic on both databases: the conflict is resolved against the row as it is when the statement
writes, and a concurrent insert of the same key waits for the other transaction to finish.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlmodel.ext.asyncio.session import AsyncSession


def upsert(session: AsyncSession, table: sa.Table) -> postgresql.Insert | sqlite.Insert:
    """An ``INSERT`` into ``table`` for the session's database, with ``on_conflict_do_update``
    and ``on_conflict_do_nothing`` (the same signature on both dialects)."""
    if session.get_bind().dialect.name == "postgresql":
        return postgresql.insert(table)
    return sqlite.insert(table)
