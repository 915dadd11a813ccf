"""Message names: stable and versioned (context.event-name.v1), declared on the class and stored
instead of the Python qualname; ordering keys bounded to what the outbox stores.

Messages with stable, versioned names.

Every message class declares its name when it is defined::

    @dataclass(frozen=True, kw_only=True)
    class OrderPlaced(DomainEvent, name="orders.order-placed.v1", ordered=True):
        ...

The stored name, never the Python qualname, is what outbox rows and broker headers carry, so a
class can be renamed or moved without orphaning rows already written. ``ordered=True`` makes the
aggregate id the event's ordering key: the processor never delivers it before an earlier event
with the same key. A key is at most ``MAX_ORDERING_KEY_LENGTH`` characters, checked when the
message is made: the outbox stores it (with its kind in front) in a bounded column, and a key
refused by the database at commit would fail the whole business transaction."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import ClassVar

from outbox_kit.domain.errors import DomainError

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
