"""Messages with stable, versioned names.

Every message class declares its name when it is defined::

    @dataclass(frozen=True, kw_only=True)
    class OrderPlaced(DomainEvent, name="orders.order-placed.v1", ordered=True):
        ...

The stored name, never the Python qualname, is what outbox rows and broker headers carry, so a
class can be renamed or moved without orphaning rows already written. ``ordered=True`` makes the
aggregate id the event's ordering key: the processor never delivers it before an earlier event
with the same key. A key is at most ``MAX_ORDERING_KEY_LENGTH`` characters, checked when the
message is made: the outbox stores it (with its kind in front) in a bounded column, and a key
refused by the database at commit would fail the whole business transaction.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import ClassVar

from .names import check_ordering_key, validate_event_name


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
