"""The example Order aggregate: invariants refuse bad orders before any event is raised."""

from __future__ import annotations

from decimal import Decimal

import pytest
from outbox_kit.domain import (
    DomainError,
)

from {{ cookiecutter.package_name }}.contexts.orders.domain import (
    MAX_LINES,
    InvalidOrderError,
    Order,
    OrderCancelled,
    OrderLine,
    OrderPlaced,
    OrderStatus,
)

pytestmark = pytest.mark.unit
BOOK = OrderLine(sku="BOOK", quantity=2, unit_price=Decimal("9.99"))


def place(*lines: OrderLine, customer_id: str = "c-1") -> Order:
    return Order.place("o-1", tenant_id="acme", customer_id=customer_id, lines=lines)


def test_placing_raises_one_event_and_applies_it() -> None:
    order = place(BOOK, OrderLine(sku="PEN", quantity=1, unit_price=Decimal("1.50")))
    (event,) = order.pending_events
    assert isinstance(event, OrderPlaced)
    assert (event.aggregate_id, event.ordering_key()) == ("o-1", "o-1")
    assert (order.status, order.customer_id, order.total) == (OrderStatus.PLACED, "c-1", Decimal("21.48"))


@pytest.mark.parametrize(
    ("lines", "customer", "field", "message"),
    [
        ((BOOK,), "  ", ("customer_id",), "customer_id must not be blank"),
        ((), "c-1", ("lines",), "an order needs 1 to 100 lines, got 0"),
        ((BOOK,) * (MAX_LINES + 1), "c-1", ("lines",), "got 101"),
        ((BOOK, OrderLine(" ", 1, Decimal(1))), "c-1", ("lines", 1, "sku"), "line 2: sku must not be blank"),
        ((OrderLine("X", 0, Decimal(1)),), "c-1", ("lines", 0, "quantity"), "quantity must be between"),
        ((OrderLine("X", 1, Decimal(-1)),), "c-1", ("lines", 0, "unit_price"), "must not be negative"),
    ],
)
def test_invalid_orders_are_refused_naming_the_field(
    lines: tuple[OrderLine, ...], customer: str, field: tuple[str | int, ...], message: str
) -> None:
    with pytest.raises(InvalidOrderError, match=message) as refused:
        place(*lines, customer_id=customer)
    assert refused.value.field == field


def test_cancelling_twice_is_refused_and_raises_no_second_event() -> None:
    order = place(BOOK)
    order.cancel("  ")
    assert order.status is OrderStatus.CANCELLED
    assert order.cancel_reason == "no reason given"
    with pytest.raises(DomainError, match="already cancelled") as refused:
        order.cancel("again")
    assert refused.value.code == "already_cancelled"
    assert [type(e) for e in order.pending_events] == [OrderPlaced, OrderCancelled]
