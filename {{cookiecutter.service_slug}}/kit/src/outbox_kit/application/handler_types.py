"""What a handler is: a callable of the message and the unit of work it must not commit; and a
consumer: an integration-event handler with the durable name its inbox rows and queues use,
and handler_name, the readable dotted name of any handler for logs and errors."""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from ..domain.events import Message
from .unit_of_work import UnitOfWork

M_contra = TypeVar("M_contra", bound=Message, contravariant=True)
M = TypeVar("M", bound=Message)


class Handler(Protocol[M_contra]):
    """Reacts to one message inside a unit of work it must not commit."""

    def __call__(self, message: M_contra, uow: UnitOfWork, /) -> Awaitable[None]: ...


def handler_name(handler: object) -> str:
    """A readable dotted name for logs and error messages."""
    target = handler
    if not hasattr(target, "__qualname__"):
        target = type(handler)
    module = getattr(target, "__module__", "?")
    return f"{module}.{getattr(target, '__qualname__', repr(target))}"


@dataclass(frozen=True)
class Consumer(Generic[M]):
    """An integration-event handler with the durable name its inbox rows and queues use."""

    name: str
    event_type: type[M]
    handler: Handler[M]
