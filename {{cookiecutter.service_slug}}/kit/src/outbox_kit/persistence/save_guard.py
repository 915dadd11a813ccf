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

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session
from sqlmodel import Session as SQLModelSession

_running_handler: ContextVar[str | None] = ContextVar("running_handler", default=None)


class HandlerMustNotSaveError(RuntimeError):
    """A handler tried to commit while the unit of work was dispatching to it."""

    def __init__(self, handler: str) -> None:
        super().__init__(
            f"handler {handler} tried to commit a unit of work while it was being dispatched. "
            "Handlers mutate state, raise events or enqueue work; the unit of work that "
            "dispatched them saves it together with the delivery record. Move an independent "
            "write to an internal command (uow.schedule) instead."
        )
        self.handler = handler


@contextmanager
def handler_scope(name: str) -> Iterator[None]:
    """Mark the block as running handler ``name``: any commit inside it is refused."""
    token = _running_handler.set(name)
    try:
        yield
    finally:
        _running_handler.reset(token)


def running_handler() -> str | None:
    return _running_handler.get()


def refuse_commit_in_handler() -> None:
    handler = running_handler()
    if handler is not None:
        raise HandlerMustNotSaveError(handler)


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
