"""The service's own audit and inbox tables: one row per consumed message per consumer (its primary
key is the deduplication guard), and one row per dead-letter replay."""

from __future__ import annotations

import uuid
from datetime import datetime

import sqlalchemy as sa
from sqlmodel import Field, SQLModel

from .tables import JSON_TYPE


class InboxMessage(SQLModel, table=True):
    """One consumed message per consumer; the primary key is the deduplication guard."""

    __tablename__ = "inbox_messages"
    __table_args__ = (sa.Index("ix_inbox_messages_received_on", "received_on"),)

    message_id: str = Field(primary_key=True, max_length=128)
    consumer: str = Field(primary_key=True, max_length=200)
    event_name: str = Field(max_length=200)
    tenant_id: str | None = Field(default=None, max_length=64)
    correlation_id: str | None = Field(default=None, max_length=64)
    received_on: datetime


class DeadLetterReplay(SQLModel, table=True):
    """Audit record of one replay: who returned which dead letters to the pending pool, when."""

    __tablename__ = "dead_letter_replays"

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    source: str = Field(max_length=32)
    replayed_by: str = Field(max_length=128)
    replayed_on: datetime
    message_count: int
    message_ids: list[str] = Field(sa_type=JSON_TYPE, nullable=False)


INBOX_TABLE: sa.Table = InboxMessage.__table__  # type: ignore[attr-defined]
