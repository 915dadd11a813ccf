"""The service's own audit, inbox and idempotency tables: one row per consumed message per consumer
(its primary key is the deduplication guard), one row per dead-letter replay, and one row per
answered idempotency key per tenant."""

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
    # SHA-256 (hex) of the signed body: a later message under this id with another body is a
    # conflict, not a copy. NULL on rows received before the column existed.
    body_digest: str | None = Field(default=None, max_length=64)


class DeadLetterReplay(SQLModel, table=True):
    """Audit record of one replay: who returned which dead letters to the pending pool, when."""

    __tablename__ = "dead_letter_replays"

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    source: str = Field(max_length=32)
    replayed_by: str = Field(max_length=128)
    replayed_on: datetime
    message_count: int
    message_ids: list[str] = Field(sa_type=JSON_TYPE, nullable=False)


class IdempotencyKey(SQLModel, table=True):
    """One create request per ``(tenant, Idempotency-Key)``, written in the transaction that ran
    it, with the answer it got (see ``idempotency/keys.py``). The primary key is the guard that
    makes a concurrent retry wait for, then repeat, the first answer."""

    __tablename__ = "idempotency_keys"
    __table_args__ = (sa.Index("ix_idempotency_keys_created_on", "created_on"),)

    tenant_id: str = Field(primary_key=True, max_length=64)  # "" for a caller without a tenant
    key: str = Field(primary_key=True, max_length=255)
    fingerprint: str = Field(max_length=64)  # SHA-256 (hex) of the operation and its body
    status_code: int | None = None
    # The answer's exact JSON text (not JSONB, which reorders keys): a replay repeats its bytes.
    response_body: str | None = Field(default=None, sa_type=sa.Text)
    created_on: datetime


INBOX_TABLE: sa.Table = InboxMessage.__table__  # type: ignore[attr-defined]
IDEMPOTENCY_KEYS_TABLE: sa.Table = IdempotencyKey.__table__  # type: ignore[attr-defined]
