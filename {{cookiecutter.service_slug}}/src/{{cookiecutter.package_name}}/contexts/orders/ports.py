"""What the orders use cases need from storage, as Protocols (the adapters are in
``infrastructure``; ``module.py`` maps each port to its adapter)."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import Protocol

from .domain import Order


class Orders(Protocol):
    """Orders of the current tenant; ``get`` raises ``NotFoundError`` for a foreign or absent id."""

    def add(self, order: Order) -> None: ...

    async def get(self, order_id: str) -> Order: ...


@dataclass
class OrderSummary:
    """The read model of one order."""

    order_id: str
    tenant_id: str
    status: str
    line_count: int
    total: Decimal
    events_applied: int


class OrderSummaries(Protocol):
    """Read model store; ``save`` stages the change, the unit of work commits it."""

    async def get(self, order_id: str) -> OrderSummary | None: ...

    def save(self, summary: OrderSummary) -> None: ...


class CustomerCounters(Protocol):
    """Per-customer counters (kept by an internal command)."""

    async def count_order(self, tenant_id: str, customer_id: str) -> int: ...
