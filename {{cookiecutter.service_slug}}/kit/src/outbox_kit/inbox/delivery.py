"""The delivery an integration-event handler is running for (message id, event name, consumer),
available to the handler through current_delivery()."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(frozen=True)
class Delivery:
    """The message a consumer handler is running for."""

    message_id: str
    event_name: str
    consumer: str


_delivery: ContextVar[Delivery | None] = ContextVar("delivery", default=None)


def current_delivery() -> Delivery:
    """The delivery being consumed (raises outside a consumer handler)."""
    delivery = _delivery.get()
    if delivery is None:
        msg = "current_delivery() is only available inside an integration-event handler"
        raise LookupError(msg)
    return delivery


@contextmanager
def delivering(delivery: Delivery) -> Iterator[None]:
    token = _delivery.set(delivery)
    try:
        yield
    finally:
        _delivery.reset(token)
