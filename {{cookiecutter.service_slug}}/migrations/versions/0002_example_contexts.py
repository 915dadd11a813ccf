"""Example contexts: orders (aggregate, read model, counters) and notifications.

Kept out of the core revision so that generating the service without the example removes it.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")
UTC_DATETIME = sqlmodel.sql.sqltypes.UTCDateTime
TEXT = sqlmodel.sql.sqltypes.AutoString


def upgrade() -> None:
    op.create_table(
        "orders",
        sa.Column("id", TEXT(length=64), nullable=False),
        sa.Column("tenant_id", TEXT(length=64), nullable=False),
        sa.Column("customer_id", TEXT(length=128), nullable=False),
        sa.Column("status", TEXT(length=16), nullable=False),
        sa.Column("lines", JSON, nullable=False),
        sa.Column("total", sa.Numeric(precision=14, scale=2), nullable=False),
        sa.Column("cancel_reason", TEXT(length=500), nullable=True),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("created_on", UTC_DATETIME(), nullable=False),
        sa.Column("updated_on", UTC_DATETIME(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_orders_tenant_customer", "orders", ["tenant_id", "customer_id"], unique=False)
    op.create_table(
        "order_summaries",
        sa.Column("order_id", TEXT(length=64), nullable=False),
        sa.Column("tenant_id", TEXT(length=64), nullable=False),
        sa.Column("status", TEXT(length=16), nullable=False),
        sa.Column("line_count", sa.Integer(), nullable=False),
        sa.Column("total", sa.Numeric(precision=14, scale=2), nullable=False),
        sa.Column("events_applied", sa.Integer(), nullable=False),
        sa.Column("updated_on", UTC_DATETIME(), nullable=False),
        sa.PrimaryKeyConstraint("order_id"),
    )
    op.create_index("ix_order_summaries_tenant_id", "order_summaries", ["tenant_id"], unique=False)
    op.create_table(
        "customer_statistics",
        sa.Column("tenant_id", TEXT(length=64), nullable=False),
        sa.Column("customer_id", TEXT(length=128), nullable=False),
        sa.Column("orders_placed", sa.Integer(), nullable=False),
        sa.Column("updated_on", UTC_DATETIME(), nullable=False),
        sa.PrimaryKeyConstraint("tenant_id", "customer_id"),
    )
    op.create_table(
        "notifications",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("tenant_id", TEXT(length=64), nullable=True),
        sa.Column("order_id", TEXT(length=64), nullable=False),
        sa.Column("event_name", TEXT(length=200), nullable=False),
        sa.Column("message_id", TEXT(length=128), nullable=False),
        sa.Column("user_id", TEXT(length=128), nullable=True),
        sa.Column("correlation_id", TEXT(length=64), nullable=True),
        sa.Column("created_on", UTC_DATETIME(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_notifications_tenant_order", "notifications", ["tenant_id", "order_id"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_notifications_tenant_order", table_name="notifications")
    op.drop_table("notifications")
    op.drop_table("customer_statistics")
    op.drop_index("ix_order_summaries_tenant_id", table_name="order_summaries")
    op.drop_table("order_summaries")
    op.drop_index("ix_orders_tenant_customer", table_name="orders")
    op.drop_table("orders")
