"""Use cases and handlers of the orders context.

The use cases load or create aggregates through the unit of work and return; the caller commits
(``uow.run`` commits and retries transient failures). The handlers react to domain events and
internal commands: they mutate read models, enqueue integration events and schedule commands,
and never save: the unit of work that dispatches them commits their effects with the event's
processed stamp, in one transaction.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from decimal import Decimal

from outbox_kit.domain import DomainError
from outbox_kit.public import InternalCommand, UnitOfWork, current_context

from ...contracts.orders import OrderCancelledV1, OrderPlacedV1
from .domain import Order, OrderCancelled, OrderLine, OrderPlaced
from .ports import CustomerCounters, Orders, OrderSummaries, OrderSummary


class CountCustomerOrder(InternalCommand, name="orders.count-customer-order.v1"):
    """Bump a customer's order counter: an independent follow-up of placing an order."""

    tenant_id: str
    customer_id: str
    order_id: str


@dataclass(frozen=True)
class PlaceOrder:
    customer_id: str
    lines: tuple[OrderLine, ...]


def _tenant() -> str:
    tenant = current_context().tenant_id
    if tenant is None:
        msg = "an order needs a tenant"
        raise DomainError(msg, code="no_tenant")
    return tenant


async def place_order(uow: UnitOfWork, command: PlaceOrder) -> Order:
    tenant = _tenant()
    order = Order.place(
        uuid.uuid4().hex, tenant_id=tenant, customer_id=command.customer_id, lines=command.lines
    )
    uow.repository(Orders).add(order)
    uow.schedule(CountCustomerOrder(tenant_id=tenant, customer_id=command.customer_id, order_id=order.id))
    return order


async def cancel_order(uow: UnitOfWork, order_id: str, reason: str) -> Order:
    order = await uow.repository(Orders).get(order_id)
    order.cancel(reason)
    return order


async def get_order(uow: UnitOfWork, order_id: str) -> Order:
    return await uow.repository(Orders).get(order_id)


# -- domain-event handlers (they do not save) --------------------------------------------


async def project_order_placed(event: OrderPlaced, uow: UnitOfWork) -> None:
    """Keep the order summary read model current."""
    summaries = uow.repository(OrderSummaries)
    if await summaries.get(event.aggregate_id) is not None:
        return  # already projected (a redelivery after a lost stamp)
    total = sum((line.amount for line in event.lines), Decimal(0))
    summaries.save(
        OrderSummary(
            order_id=event.aggregate_id,
            tenant_id=event.tenant_id,
            status="placed",
            line_count=len(event.lines),
            total=total,
            events_applied=1,
        )
    )


async def project_order_cancelled(event: OrderCancelled, uow: UnitOfWork) -> None:
    summaries = uow.repository(OrderSummaries)
    summary = await summaries.get(event.aggregate_id)
    if summary is not None and summary.status != "cancelled":
        summary.status = "cancelled"
        summary.events_applied += 1
        summaries.save(summary)


async def announce_order_placed(event: OrderPlaced, uow: UnitOfWork) -> None:
    """Translate the domain event into the published integration event."""
    total = sum((line.amount for line in event.lines), Decimal(0))
    uow.enqueue(
        OrderPlacedV1(
            aggregate_id=event.aggregate_id,
            order_id=event.aggregate_id,
            customer_id=event.customer_id,
            total=str(total),
            line_count=len(event.lines),
        )
    )


async def announce_order_cancelled(event: OrderCancelled, uow: UnitOfWork) -> None:
    uow.enqueue(
        OrderCancelledV1(aggregate_id=event.aggregate_id, order_id=event.aggregate_id, reason=event.reason)
    )


# -- internal-command handlers ------------------------------------------------------------


async def count_customer_order(command: CountCustomerOrder, uow: UnitOfWork) -> None:
    await uow.repository(CustomerCounters).count_order(command.tenant_id, command.customer_id)
