"""Entities and event-sourcing-style aggregate roots."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, ClassVar, TypeVar

from outbox_kit.domain.events import DomainEvent

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
