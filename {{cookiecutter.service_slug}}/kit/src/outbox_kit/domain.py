"""The kit's domain: aggregates, domain events, message names and domain errors. Standard
library only: a context's domain layer imports this and nothing else of the kit, so every domain
model stays plain Python.

**Aggregates** are written event-sourcing style: state changes only by raising an event that is
applied (``_raise`` calls the ``@applies`` method and appends the event to the pending list), so
every change is an event and an event-store persistence can be added without rewriting them.

**Messages have stable, versioned names** (``context.event-name.v1``), declared on the class
when it is defined::

    @dataclass(frozen=True, kw_only=True)
    class OrderPlaced(DomainEvent, name="orders.order-placed.v1", ordered=True):
        ...

The stored name, never the Python qualname, is what outbox rows and broker headers carry, so a
class can be renamed or moved without orphaning rows already written. ``ordered=True`` makes the
aggregate id the event's ordering key: the processor never delivers it before an earlier event
with the same key. A key is at most ``MAX_ORDERING_KEY_LENGTH`` characters, checked when the
message is made: the outbox stores it (with its kind in front) in a bounded column, and a key
refused by the database at commit would fail the whole business transaction.

**Errors** the domain and the persistence layer raise in business terms (not found, a
concurrent change, a rule broken), which the HTTP edge answers with stable codes."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, ClassVar, TypeVar


class DomainError(Exception):
    """A business rule refused the operation (the API answers 409/422 with this message).

    ``field`` names the input the rule is about (``("lines", 0, "sku")``) when there is one, so
    the API reports it where request validation reports its own errors.
    """

    def __init__(
        self, message: str, *, code: str = "domain_error", field: tuple[str | int, ...] | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.field = field


class NotFoundError(DomainError):
    """The aggregate does not exist, or belongs to another tenant (indistinguishable: 404)."""

    def __init__(self, kind: str, identifier: object) -> None:
        super().__init__(f"{kind} {identifier} was not found", code="not_found")


class ConcurrencyError(DomainError):
    """Another writer changed the aggregate since it was loaded (optimistic concurrency)."""

    def __init__(self, kind: str, identifier: object, expected_version: int) -> None:
        super().__init__(
            f"{kind} {identifier} was changed by someone else (expected version "
            f"{expected_version}); reload it and try again",
            code="concurrency_conflict",
        )


MAX_ORDERING_KEY_LENGTH = 128

_NAME = re.compile(r"[a-z][a-z0-9-]*(?:\.[a-z][a-z0-9-]*)+\.v[1-9][0-9]*")


def validate_event_name(name: str) -> str:
    """Names look like ``context.event-name.v1``: lowercase, dotted, ending in a version."""
    if not _NAME.fullmatch(name):
        msg = (
            f"message name {name!r} must look like 'context.event-name.v1' "
            "(lowercase words, dots, a trailing version)"
        )
        raise ValueError(msg)
    return name


class OrderingKeyTooLongError(DomainError):
    """A message's ordering key is longer than the outbox stores (answered as 422 by the API)."""

    def __init__(self, message_name: str, length: int) -> None:
        super().__init__(
            f"the ordering key of {message_name} is {length} characters; at most "
            f"{MAX_ORDERING_KEY_LENGTH} characters are allowed (MAX_ORDERING_KEY_LENGTH)",
            code="invalid",
        )


def check_ordering_key(message_name: str, key: str | None) -> None:
    """Refuse a message whose ordering key the outbox cannot store (called when it is made)."""
    if key is not None and len(key) > MAX_ORDERING_KEY_LENGTH:
        raise OrderingKeyTooLongError(message_name, len(key))


def utc_now() -> datetime:
    return datetime.now(UTC)


class Message:
    """Base of everything that travels through the outbox: events and internal commands."""

    message_name: ClassVar[str]
    ordered: ClassVar[bool] = False

    def __init_subclass__(cls, name: str | None = None, ordered: bool = False, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if name is not None:
            cls.message_name = validate_event_name(name)
            cls.ordered = ordered
        elif ordered:
            msg = f"{cls.__qualname__}: ordered=True needs a name"
            raise TypeError(msg)

    @classmethod
    def has_name(cls) -> bool:
        return "message_name" in cls.__dict__

    def ordering_key(self) -> str | None:
        """The key that serialises delivery, or None for unordered messages."""
        return None


@dataclass(frozen=True, kw_only=True)
class DomainEvent(Message):
    """Something that happened inside one aggregate, handled in-process (never on a broker)."""

    aggregate_id: str
    event_id: uuid.UUID = field(default_factory=uuid.uuid4)
    occurred_on: datetime = field(default_factory=utc_now)

    def __post_init__(self) -> None:
        check_ordering_key(self.message_name, self.ordering_key())

    def ordering_key(self) -> str | None:
        return self.aggregate_id if self.ordered else None


E = TypeVar("E", bound=DomainEvent)
_APPLIES = "__applies_event__"


def applies(event_type: type[E]) -> Callable[[Callable[[Any, E], None]], Callable[[Any, E], None]]:
    """Mark an aggregate method as the one that applies ``event_type`` to its state."""

    def mark(method: Callable[[Any, E], None]) -> Callable[[Any, E], None]:
        setattr(method, _APPLIES, event_type)
        return method

    return mark


class Entity:
    """Something with an identity that outlives changes to its attributes."""

    def __init__(self, entity_id: str) -> None:
        self.id = entity_id

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and isinstance(other, Entity) and other.id == self.id

    def __hash__(self) -> int:
        return hash((type(self), self.id))


class AggregateRoot(Entity):
    """A consistency boundary whose state changes only by raising events.

    ``version`` is the optimistic-concurrency version the repository loaded (0 for a new
    aggregate); the repository refuses a write when the stored version moved on meanwhile.
    """

    _appliers: ClassVar[dict[type[DomainEvent], Callable[[Any, Any], None]]] = {}

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        appliers = dict(cls._appliers)
        for member in vars(cls).values():
            event_type = getattr(member, _APPLIES, None)
            if event_type is not None:
                appliers[event_type] = member
        cls._appliers = appliers

    def __init__(self, entity_id: str, *, version: int = 0) -> None:
        super().__init__(entity_id)
        self.version = version
        self._pending_events: list[DomainEvent] = []

    @property
    def pending_events(self) -> tuple[DomainEvent, ...]:
        """Events raised since the last successful save, oldest first."""
        return tuple(self._pending_events)

    def _raise(self, event: DomainEvent) -> None:
        """Apply ``event`` to the state, then keep it pending for the unit of work."""
        applier = self._appliers.get(type(event))
        if applier is None:
            msg = f"{type(self).__name__} has no @applies({type(event).__name__}) method"
            raise TypeError(msg)
        applier(self, event)
        self._pending_events.append(event)

    def remove_events(self, captured: Iterable[DomainEvent]) -> None:
        """Drop exactly the events a save captured; events raised later stay pending."""
        gone = {id(event) for event in captured}
        self._pending_events = [e for e in self._pending_events if id(e) not in gone]


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
