"""The table of the notifications context: one row per notification recorded for an order."""

from __future__ import annotations

import uuid
from datetime import datetime

import sqlalchemy as sa
from sqlmodel import Field, SQLModel


class NotificationRow(SQLModel, table=True):
    """A notification: the order and the event it was for, and who caused that event."""

    __tablename__ = "notifications"
    __table_args__ = (sa.Index("ix_notifications_tenant_order", "tenant_id", "order_id"),)

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    tenant_id: str | None = Field(default=None, max_length=64)
    order_id: str = Field(max_length=64)
    event_name: str = Field(max_length=200)
    message_id: str = Field(max_length=128)
    user_id: str | None = Field(default=None, max_length=128)
    correlation_id: str | None = Field(default=None, max_length=64)
    created_on: datetime
