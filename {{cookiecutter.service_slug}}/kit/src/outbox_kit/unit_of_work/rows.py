"""The rows one commit writes: staged before the INSERT (with the live message, for in-process
dispatch) and written (with the seq the database gave them)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from ..domain.events import Message


@dataclass(frozen=True)
class StagedRow:
    """A row about to be inserted, with the live message for in-process dispatch."""

    table: sa.Table
    values: dict[str, Any]
    message: Message
    leased: bool

    @property
    def id(self) -> uuid.UUID:
        return uuid.UUID(str(self.values["id"]))

    @property
    def ordering_key(self) -> str | None:
        value = self.values.get("ordering_key")
        return None if value is None else str(value)


@dataclass
class WrittenRow:
    """A row that committed, as the in-process dispatcher needs it."""

    id: uuid.UUID
    seq: int
    ordering_key: str | None
    lock_token: uuid.UUID
    message: Message


@dataclass
class Capture:
    """Everything one commit writes."""

    rows: list[StagedRow] = field(default_factory=list)
    lock_token: uuid.UUID = field(default_factory=uuid.uuid4)

    @property
    def needs_wake(self) -> bool:
        """True when some row is for the processor (not leased to this process)."""
        return any(not row.leased for row in self.rows)
