"""The runtime half of handlers do not save: while a handler runs, its name is in a context
variable, and a COMMIT on any session or connection of the service's engines is refused before
it reaches the database, naming the handler."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

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
