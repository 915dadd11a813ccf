"""The tables of the orders context: the order (the aggregate's snapshot with its version), the
summary read model and the per-customer counters."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Any

import sqlalchemy as sa
from outbox_kit.public import JSON_TYPE
from sqlmodel import Field, SQLModel


class OrderRow(SQLModel, table=True):
    """The current state of an order (the aggregate's snapshot), with its version."""

    __tablename__ = "orders"
    __table_args__ = (sa.Index("ix_orders_tenant_customer", "tenant_id", "customer_id"),)

    id: str = Field(primary_key=True, max_length=64)
    tenant_id: str = Field(max_length=64)
    customer_id: str = Field(max_length=128)
    status: str = Field(max_length=16)
    lines: list[dict[str, Any]] = Field(sa_type=JSON_TYPE, nullable=False)
    total: Decimal = Field(max_digits=14, decimal_places=2)
    cancel_reason: str | None = Field(default=None, max_length=500)
    version: int
    created_on: datetime
    updated_on: datetime


class OrderSummaryRow(SQLModel, table=True):
    """Read model kept by a domain-event handler (it never saves: its unit of work does)."""

    __tablename__ = "order_summaries"

    order_id: str = Field(primary_key=True, max_length=64)
    tenant_id: str = Field(max_length=64, index=True)
    status: str = Field(max_length=16)
    line_count: int
    total: Decimal = Field(max_digits=14, decimal_places=2)
    events_applied: int = 0
    updated_on: datetime


class CustomerStatisticsRow(SQLModel, table=True):
    """Per-customer counters, kept by an internal command (an independent follow-up)."""

    __tablename__ = "customer_statistics"

    tenant_id: str = Field(primary_key=True, max_length=64)
    customer_id: str = Field(primary_key=True, max_length=128)
    orders_placed: int = 0
    updated_on: datetime


ORDERS = OrderRow.__table__  # type: ignore[attr-defined]
CUSTOMER_STATISTICS = CustomerStatisticsRow.__table__  # type: ignore[attr-defined]
