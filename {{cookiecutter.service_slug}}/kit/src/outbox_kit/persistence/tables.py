"""The tables the outbox machinery owns: ``outbox_messages``, ``internal_commands``,
``inbox_messages`` and ``dead_letter_replays``.

``outbox_messages`` and ``internal_commands`` share one column set (:class:`PolledColumns`), so
one claim statement, one lease/backoff/dead-letter idiom and one administration service serve
both. ``seq`` is a monotonic per-row sequence (an identity column on PostgreSQL, max+1 under
SQLite's single writer): ordering keys are ordered by it, never by a timestamp that can tie.

The partial indexes cover only pending rows (neither processed nor dead-lettered), so retained
history never slows the claim; see ``polling/claim.py`` for the statement that uses them.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlmodel import JSON, Field, SQLModel

PENDING = "processed_on IS NULL AND dead_lettered_on IS NULL"
JSON_TYPE = JSON().with_variant(postgresql.JSONB(), "postgresql")


def polled_table_args(table: str) -> tuple[Any, ...]:
    """Indexes of a polled table: the claim's four, the smart wait's two, cleanup's two."""

    def partial(name: str, *columns: str, where: str) -> sa.Index:
        return sa.Index(
            f"ix_{table}_{name}",
            *columns,
            postgresql_where=sa.text(where),
            sqlite_where=sa.text(where),
        )

    return (
        sa.UniqueConstraint("seq", name=f"uq_{table}_seq"),
        partial("pending_keyless", "seq", where=f"{PENDING} AND ordering_key IS NULL"),
        partial("pending_keyed_seq", "seq", where=f"{PENDING} AND ordering_key IS NOT NULL"),
        partial("pending_key_seq", "ordering_key", "seq", where=f"{PENDING} AND ordering_key IS NOT NULL"),
        # Keys with a row in flight: few rows (only live leases), probed once per claimed head.
        partial(
            "pending_leased_key",
            "ordering_key",
            where=f"{PENDING} AND ordering_key IS NOT NULL AND lock_token IS NOT NULL",
        ),
        partial("pending_locked", "locked_until", where=f"{PENDING} AND locked_until IS NOT NULL"),
        partial("pending_available", "available_on", where=f"{PENDING} AND locked_until IS NULL"),
        partial("processed_age", "processed_on", where="processed_on IS NOT NULL"),
        partial("dead_letter_age", "dead_lettered_on", where="dead_lettered_on IS NOT NULL"),
    )


class PolledColumns(SQLModel):
    """Columns shared by every table a polling processor drains."""

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    # Field(sa_type=...) rather than sa_column=Column(...): each table needs its own Column.
    seq: int | None = Field(
        default=None, sa_type=sa.BigInteger, sa_column_args=[sa.Identity()], nullable=False
    )
    payload: dict[str, Any] = Field(sa_type=JSON_TYPE, nullable=False)
    occurred_on: datetime
    available_on: datetime
    ordering_key: str | None = Field(default=None, max_length=200)
    tenant_id: str | None = Field(default=None, max_length=64)
    user_id: str | None = Field(default=None, max_length=128)
    user_roles: str | None = Field(default=None, max_length=512)
    correlation_id: str | None = Field(default=None, max_length=64)
    trace_context: str | None = Field(default=None, max_length=128)
    retry_count: int = Field(default=0, sa_column_kwargs={"server_default": "0"})
    last_error: str | None = Field(default=None, sa_type=sa.Text)
    locked_until: datetime | None = None
    lock_token: uuid.UUID | None = None
    locked_by: str | None = Field(default=None, max_length=128)
    processed_on: datetime | None = None
    dead_lettered_on: datetime | None = None
    dead_letter_reason: str | None = Field(default=None, max_length=64)


class OutboxMessage(PolledColumns, table=True):
    """One event written in the same transaction as the business change that raised it.

    ``kind`` is ``domain`` (dispatched in-process, possibly inserted already leased to the
    committing process) or ``integration`` (published through the message bus).
    """

    __tablename__ = "outbox_messages"
    __table_args__ = polled_table_args("outbox_messages")

    event_name: str = Field(max_length=200)
    kind: str = Field(max_length=16)


class InternalCommand(PolledColumns, table=True):
    """A deferred instruction, run by the internal-command processor when due."""

    __tablename__ = "internal_commands"
    __table_args__ = polled_table_args("internal_commands")

    command_name: str = Field(max_length=200)


# -- the one definition the rest of the service uses ----------------------------------------

OUTBOX_TABLE: sa.Table = OutboxMessage.__table__  # type: ignore[attr-defined]
COMMAND_TABLE: sa.Table = InternalCommand.__table__  # type: ignore[attr-defined]
DOMAIN = "domain"  # an outbox row dispatched in-process (a domain event)
INTEGRATION = "integration"  # an outbox row published through the message bus


@dataclass(frozen=True)
class PolledTable:
    """A table a processor drains, by the name operators use for it."""

    name: str
    table: sa.Table
    name_column: str


OUTBOX = PolledTable("outbox", OUTBOX_TABLE, "event_name")
INTERNAL_COMMANDS = PolledTable("internal_commands", COMMAND_TABLE, "command_name")
POLLED_TABLES: dict[str, PolledTable] = {t.name: t for t in (OUTBOX, INTERNAL_COMMANDS)}
