"""Integration events published by the orders context (consumed by ``notifications``).

Both are ``ordered=True`` with the order id as the key: the outbox publishes an order's events
one after the other, the next only once the broker confirmed the previous one. That is an order
of *publishing*. A consumer sees them in that order while nothing is redelivered; a retried
placement can arrive after its cancel (RabbitMQ's retry queue, Redis's reclaimer, NATS's delayed
nack), so a consumer that cares compares what it has instead of trusting arrival order.
"""

from outbox_kit.public import IntegrationEvent
from pydantic import Field


class OrderPlacedV1(IntegrationEvent, name="orders.order-placed.v1", ordered=True):
    """An order was placed (published before any later event of the same order)."""

    order_id: str
    customer_id: str
    total: str = Field(description="Decimal amount as a string, e.g. '19.98'")
    line_count: int


class OrderCancelledV1(IntegrationEvent, name="orders.order-cancelled.v1", ordered=True):
    """An order was cancelled."""

    order_id: str
    reason: str


MESSAGES = (OrderPlacedV1, OrderCancelledV1)
