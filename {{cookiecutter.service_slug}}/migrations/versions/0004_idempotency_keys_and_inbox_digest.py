"""Idempotency keys, and the body digest of each inbox row.

``idempotency_keys``: one row per answered ``Idempotency-Key`` per tenant, written in the
transaction of the command it guards (its primary key makes a concurrent retry wait and repeat
the first answer); ``created_on`` is indexed for the retention sweep.

``inbox_messages.body_digest``: the SHA-256 of a consumed message's signed body, so a second
message under the same id with another body is dead-lettered (``conflicting_duplicate``)
instead of skipped as a copy. Rows consumed before this revision keep NULL (compared with
nothing: a copy of them is still skipped).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-05
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

UTC_DATETIME = sqlmodel.sql.sqltypes.UTCDateTime
TEXT = sqlmodel.sql.sqltypes.AutoString


def upgrade() -> None:
    op.create_table(
        "idempotency_keys",
        sa.Column("tenant_id", TEXT(length=64), nullable=False),
        sa.Column("key", TEXT(length=255), nullable=False),
        sa.Column("fingerprint", TEXT(length=64), nullable=False),
        sa.Column("status_code", sa.Integer(), nullable=True),
        sa.Column("response_body", sa.Text(), nullable=True),
        sa.Column("created_on", UTC_DATETIME(), nullable=False),
        sa.PrimaryKeyConstraint("tenant_id", "key"),
    )
    op.create_index("ix_idempotency_keys_created_on", "idempotency_keys", ["created_on"], unique=False)
    with op.batch_alter_table("inbox_messages") as batch:
        batch.add_column(sa.Column("body_digest", TEXT(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("inbox_messages") as batch:
        batch.drop_column("body_digest")
    op.drop_index("ix_idempotency_keys_created_on", table_name="idempotency_keys")
    op.drop_table("idempotency_keys")
