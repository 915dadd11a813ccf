"""The kit's domain: pure standard library, so every domain model stays pure too.

Aggregates are written event-sourcing style: state changes only by raising an event that is
applied (``_raise`` calls the ``@applies`` method and appends the event to the pending list), so
every change is an event and an event-store persistence can be added without rewriting them."""

from __future__ import annotations

from outbox_kit.domain.aggregate import AggregateRoot, Entity, applies
from outbox_kit.domain.errors import ConcurrencyError, DomainError, NotFoundError
from outbox_kit.domain.events import (
    MAX_ORDERING_KEY_LENGTH,
    DomainEvent,
    Message,
    OrderingKeyTooLongError,
    validate_event_name,
)

__all__ = [
    "MAX_ORDERING_KEY_LENGTH",
    "AggregateRoot",
    "ConcurrencyError",
    "DomainError",
    "DomainEvent",
    "Entity",
    "Message",
    "NotFoundError",
    "OrderingKeyTooLongError",
    "applies",
    "validate_event_name",
]
