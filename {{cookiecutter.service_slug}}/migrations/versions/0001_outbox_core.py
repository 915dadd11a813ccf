"""Outbox core: outbox_messages, internal_commands, inbox_messages, dead_letter_replays.

The two polled tables share one column set and one index set: the claim's three partial indexes
on pending rows (keyless by seq, keyed by seq, keyed by (key, seq)), the smart wait's two, and
the retention sweep's two. Partial indexes keep processed history out of the hot path.

Revision ID: 0001
Revises:
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

PENDING = "processed_on IS NULL AND dead_lettered_on IS NULL"
JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")
UTC_DATETIME = sqlmodel.sql.sqltypes.UTCDateTime
TEXT = sqlmodel.sql.sqltypes.AutoString
INDEXES = (
    ("pending_keyless", ["seq"], f"{PENDING} AND ordering_key IS NULL"),
    ("pending_keyed_seq", ["seq"], f"{PENDING} AND ordering_key IS NOT NULL"),
    ("pending_key_seq", ["ordering_key", "seq"], f"{PENDING} AND ordering_key IS NOT NULL"),
    ("pending_locked", ["locked_until"], f"{PENDING} AND locked_until IS NOT NULL"),
    ("pending_available", ["available_on"], f"{PENDING} AND locked_until IS NULL"),
    ("processed_age", ["processed_on"], "processed_on IS NOT NULL"),
    ("dead_letter_age", ["dead_lettered_on"], "dead_lettered_on IS NOT NULL"),
)


def _create_polled_table(name: str, *own_columns: sa.Column[object]) -> None:
    op.create_table(
        name,
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("seq", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("payload", JSON, nullable=False),
        sa.Column("occurred_on", UTC_DATETIME(), nullable=False),
        sa.Column("available_on", UTC_DATETIME(), nullable=False),
        sa.Column("ordering_key", TEXT(length=200), nullable=True),
        sa.Column("tenant_id", TEXT(length=64), nullable=True),
        sa.Column("user_id", TEXT(length=128), nullable=True),
        sa.Column("user_roles", TEXT(length=512), nullable=True),
        sa.Column("correlation_id", TEXT(length=64), nullable=True),
        sa.Column("trace_context", TEXT(length=128), nullable=True),
        sa.Column("retry_count", sa.Integer(), server_default="0", nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("locked_until", UTC_DATETIME(), nullable=True),
        sa.Column("lock_token", sa.Uuid(), nullable=True),
        sa.Column("locked_by", TEXT(length=128), nullable=True),
        sa.Column("processed_on", UTC_DATETIME(), nullable=True),
        sa.Column("dead_lettered_on", UTC_DATETIME(), nullable=True),
        sa.Column("dead_letter_reason", TEXT(length=64), nullable=True),
        *own_columns,
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("seq", name=f"uq_{name}_seq"),
    )
    with op.batch_alter_table(name) as batch_op:
        for suffix, columns, where in INDEXES:
            batch_op.create_index(
                f"ix_{name}_{suffix}",
                columns,
                unique=False,
                postgresql_where=sa.text(where),
                sqlite_where=sa.text(where),
            )


def upgrade() -> None:
    _create_polled_table(
        "outbox_messages",
        sa.Column("event_name", TEXT(length=200), nullable=False),
        sa.Column("kind", TEXT(length=16), nullable=False),
    )
    _create_polled_table(
        "internal_commands",
        sa.Column("command_name", TEXT(length=200), nullable=False),
    )
    op.create_table(
        "inbox_messages",
        sa.Column("message_id", TEXT(length=128), nullable=False),
        sa.Column("consumer", TEXT(length=200), nullable=False),
        sa.Column("event_name", TEXT(length=200), nullable=False),
        sa.Column("tenant_id", TEXT(length=64), nullable=True),
        sa.Column("correlation_id", TEXT(length=64), nullable=True),
        sa.Column("received_on", UTC_DATETIME(), nullable=False),
        sa.PrimaryKeyConstraint("message_id", "consumer"),
    )
    op.create_index("ix_inbox_messages_received_on", "inbox_messages", ["received_on"], unique=False)
    op.create_table(
        "dead_letter_replays",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("source", TEXT(length=32), nullable=False),
        sa.Column("replayed_by", TEXT(length=128), nullable=False),
        sa.Column("replayed_on", UTC_DATETIME(), nullable=False),
        sa.Column("message_count", sa.Integer(), nullable=False),
        sa.Column("message_ids", JSON, nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )


def downgrade() -> None:
    op.drop_table("dead_letter_replays")
    op.drop_index("ix_inbox_messages_received_on", table_name="inbox_messages")
    op.drop_table("inbox_messages")
    for name in ("internal_commands", "outbox_messages"):
        for suffix, _columns, _where in INDEXES:
            op.drop_index(f"ix_{name}_{suffix}", table_name=name)
        op.drop_table(name)
