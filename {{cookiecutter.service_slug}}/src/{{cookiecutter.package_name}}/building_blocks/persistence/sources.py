"""The polled tables, by the name operators use for them (``outbox``, ``internal_commands``)."""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa

from .tables import InternalCommand, OutboxMessage


@dataclass(frozen=True)
class SourceTable:
    name: str
    table: sa.Table
    name_column: str


OUTBOX = SourceTable("outbox", OutboxMessage.__table__, "event_name")  # type: ignore[attr-defined]
INTERNAL_COMMANDS = SourceTable(
    "internal_commands",
    InternalCommand.__table__,  # type: ignore[attr-defined]
    "command_name",
)
SOURCES: dict[str, SourceTable] = {s.name: s for s in (OUTBOX, INTERNAL_COMMANDS)}


class UnknownSourceError(LookupError):
    """The operator named a source this service does not have."""

    def __init__(self, name: str) -> None:
        super().__init__(f"unknown source {name!r}; use one of: {', '.join(SOURCES)}")


def source_named(name: str) -> SourceTable:
    try:
        return SOURCES[name]
    except KeyError:
        raise UnknownSourceError(name) from None
