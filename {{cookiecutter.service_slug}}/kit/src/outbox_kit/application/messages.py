"""Messages that leave the aggregate: integration events and internal commands.

They are pydantic models because they cross a process boundary (a broker, or a row read back
later), so their payload is validated on the way in and documented in AsyncAPI. Domain events
stay plain dataclasses in ``outbox_kit.domain`` so the domain layer imports nothing but the
standard library.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..domain.events import Message, utc_now
from ..domain.names import check_ordering_key


class _ModelMessage(Message, BaseModel):
    """What both pydantic message kinds share: frozen, tolerant of new fields, a checked key."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    def model_post_init(self, _context: Any, /) -> None:  # noqa: ANN401 (pydantic's signature)
        check_ordering_key(self.message_name, self.ordering_key())


class IntegrationEvent(_ModelMessage):
    """A fact published to other services. Delivered only by the outbox processor."""

    event_id: uuid.UUID = Field(default_factory=uuid.uuid4)
    occurred_on: datetime = Field(default_factory=utc_now)
    aggregate_id: str | None = Field(
        default=None, description="The aggregate this event is about; its ordering key if ordered"
    )

    def ordering_key(self) -> str | None:
        return self.aggregate_id if self.ordered else None


class InternalCommand(_ModelMessage):
    """A deferred instruction to this service itself, run by its own processor."""

    command_id: uuid.UUID = Field(default_factory=uuid.uuid4)
