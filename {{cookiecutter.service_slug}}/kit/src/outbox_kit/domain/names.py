"""Message names: stable and versioned (context.event-name.v1), declared on the class and stored
instead of the Python qualname; ordering keys bounded to what the outbox stores."""

from __future__ import annotations

import re

from .errors import DomainError

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
