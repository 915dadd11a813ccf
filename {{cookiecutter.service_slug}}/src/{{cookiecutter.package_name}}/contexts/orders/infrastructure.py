"""Tables and the repository of the orders context (an adapter: only the container wires it)."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import sqlalchemy as sa
from outbox_kit.public import AdapterScope, Repository, current_context, upsert
from sqlmodel import select

from .domain import Order, OrderLine, OrderStatus
from .ports import OrderSummary
from .tables import CUSTOMER_STATISTICS, ORDERS, OrderRow, OrderSummaryRow


def _lines_to_json(lines: tuple[OrderLine, ...]) -> list[dict[str, Any]]:
    return [
        {"sku": line.sku, "quantity": line.quantity, "unit_price": str(line.unit_price)} for line in lines
    ]


def _lines_from_json(lines: list[dict[str, Any]]) -> tuple[OrderLine, ...]:
    return tuple(
        OrderLine(sku=str(x["sku"]), quantity=int(x["quantity"]), unit_price=Decimal(str(x["unit_price"])))
        for x in lines
    )


class SqlOrders(Repository[Order]):
    """Orders of the current tenant."""

    aggregate_name = "order"

    async def _load(self, aggregate_id: str) -> Order | None:
        statement = select(OrderRow).where(OrderRow.id == aggregate_id, OrderRow.tenant_id == self.tenant_id)
        row = (await self.session.exec(statement)).first()
        if row is None:
            return None
        order = Order(row.id, version=row.version)
        order.tenant_id = row.tenant_id
        order.customer_id = row.customer_id
        order.lines = _lines_from_json(row.lines)
        order.status = OrderStatus(row.status)
        order.cancel_reason = row.cancel_reason
        return order

    async def persist(self, aggregate: Order) -> int:
        now = self.scope.now
        values = {
            "status": aggregate.status.value,
            "cancel_reason": aggregate.cancel_reason,
            "updated_on": now,
        }
        if aggregate.version == 0:
            await self.session.exec(
                sa.insert(ORDERS).values(
                    id=aggregate.id,
                    tenant_id=aggregate.tenant_id,
                    customer_id=aggregate.customer_id,
                    lines=_lines_to_json(aggregate.lines),
                    total=aggregate.total,
                    version=1,
                    created_on=now,
                    **values,
                )
            )
            return 1
        return await self._versioned_update(ORDERS, aggregate, values)


class SqlOrderSummaries:
    """The order summary read model in ``order_summaries``."""

    def __init__(self, scope: AdapterScope) -> None:
        self.scope = scope
        self._rows: dict[str, OrderSummaryRow] = {}

    async def get(self, order_id: str) -> OrderSummary | None:
        statement = select(OrderSummaryRow).where(
            OrderSummaryRow.order_id == order_id, OrderSummaryRow.tenant_id == current_context().tenant_id
        )
        row = (await self.scope.session.exec(statement)).first()
        if row is None:
            return None
        self._rows[order_id] = row
        return OrderSummary(
            row.order_id, row.tenant_id, row.status, row.line_count, row.total, row.events_applied
        )

    def save(self, summary: OrderSummary) -> None:
        row = self._rows.get(summary.order_id)
        if row is None:
            row = OrderSummaryRow(
                order_id=summary.order_id,
                tenant_id=summary.tenant_id,
                status="",
                line_count=0,
                total=Decimal(0),
                updated_on=self.scope.now,
            )
            self.scope.session.add(row)
            self._rows[summary.order_id] = row
        row.status = summary.status
        row.line_count = summary.line_count
        row.total = summary.total
        row.events_applied = summary.events_applied
        row.updated_on = self.scope.now


class SqlCustomerCounters:
    """Per-customer counters in ``customer_statistics``."""

    def __init__(self, scope: AdapterScope) -> None:
        self.scope = scope

    async def count_order(self, tenant_id: str, customer_id: str) -> int:
        # One atomic statement, never read, add one, write: the command processor delivers up
        # to OUTBOX__DELIVERY_CONCURRENCY commands at once, each in a transaction of its own, and
        # two that read the same count both write count + 1 (50 orders of one customer were
        # counted 13). The database adds one to the row as it is when it writes (the second
        # writer waits for the first), and ON CONFLICT turns the first order of two racing
        # deliveries into an update instead of a unique violation. For a change that cannot be
        # one statement, load the aggregate and let its version refuse a stale save
        # (ConcurrencyError) and retry.
        now = self.scope.now
        table = CUSTOMER_STATISTICS
        statement = (
            upsert(self.scope.session, table)
            .values(tenant_id=tenant_id, customer_id=customer_id, orders_placed=1, updated_on=now)
            .on_conflict_do_update(
                index_elements=[table.c.tenant_id, table.c.customer_id],
                set_={"orders_placed": table.c.orders_placed + 1, "updated_on": now},
            )
            .returning(table.c.orders_placed)
        )
        return int((await self.scope.session.exec(statement)).scalar_one())
