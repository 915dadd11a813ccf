"""The run-time half of "handlers do not save".

While a handler runs, :func:`handler_scope` names it in a context variable. Every session the
service creates is a :class:`GuardedSession`: its ``before_commit`` hook refuses to commit while
a handler is named, so a handler cannot save by committing the unit of work, a second unit of
work, or the session underneath (the static rule in ``tests/architecture`` proves the same
before the code runs). The owner of the transaction commits after the handler returned.

Below the ORM, :func:`guard_engine` hooks every connection of the service's engines: a Core
transaction committed inside a handler (``engine.begin()``, ``connection.commit()``) is refused
the same way, before the database sees the COMMIT. What stays out of reach: an engine or a
driver connection the handler creates itself, and writes outside the database (HTTP, files).
"""

from __future__ import annotations

from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session
from sqlmodel import Session as SQLModelSession

from .handler_scope import refuse_commit_in_handler


class GuardedSession(SQLModelSession):
    """The synchronous session under every AsyncSession of the service (SQLModel's, guarded)."""


@event.listens_for(GuardedSession, "before_commit")
def _before_commit(session: Session) -> None:
    # SQLAlchemy fires before_commit for a savepoint release too; a savepoint commits nothing
    # (the owner's transaction still decides), so a handler may use one.
    if session.in_nested_transaction():
        return
    refuse_commit_in_handler()


def guard_engine(engine: Engine) -> None:
    """Refuse a COMMIT on any connection of ``engine`` while a handler runs (Core writes)."""

    @event.listens_for(engine, "commit")
    def _before_connection_commit(_connection: Connection) -> None:
        refuse_commit_in_handler()
