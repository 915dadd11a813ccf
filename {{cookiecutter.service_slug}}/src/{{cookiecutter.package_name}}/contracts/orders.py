"""Integration events published by the orders context."""

from pydantic import Field

from ..building_blocks.messages import IntegrationEvent


class OrderPlacedV1(IntegrationEvent, name="orders.order-placed.v1", ordered=True):
    """An order was placed. Ordered by order id, so it reaches consumers before its cancel."""

    order_id: str
    customer_id: str
    total: str = Field(description="Decimal amount as a string, e.g. '19.98'")
    line_count: int


class OrderCancelledV1(IntegrationEvent, name="orders.order-cancelled.v1", ordered=True):
    """An order was cancelled."""

    order_id: str
    reason: str


MESSAGES = (OrderPlacedV1, OrderCancelledV1)
