"""The orders use cases and handlers on the kit's in-memory unit of work: no database, each test
in milliseconds. This is how to unit-test a context of your own: give the fake an in-memory
adapter per port the code asks for, run the use case or the handler, commit, and assert on what
the store recorded (the same promises as the SQL unit of work: the contract test proves it)."""

from __future__ import annotations

from decimal import Decimal

import pytest
from outbox_kit.domain import NotFoundError
from outbox_kit.testing import InMemoryRepository, InMemoryStore, InMemoryUnitOfWork
from outbox_kit.testing.fixtures import acting_as

from {{ cookiecutter.package_name }}.contexts.orders.application import (
    CountCustomerOrder,
    PlaceOrder,
    announce_order_placed,
    cancel_order,
    place_order,
    project_order_placed,
)
from {{ cookiecutter.package_name }}.contexts.orders.domain import (
    Order,
    OrderCancelled,
    OrderLine,
    OrderPlaced,
    OrderStatus,
)
from {{ cookiecutter.package_name }}.contexts.orders.ports import (
    Orders,
    OrderSummaries,
    OrderSummary,
)
from {{ cookiecutter.package_name }}.contracts.orders import OrderPlacedV1

pytestmark = pytest.mark.unit
LINES = (
    OrderLine(sku="BOOK", quantity=2, unit_price=Decimal("9.99")),
    OrderLine(sku="PEN", quantity=1, unit_price=Decimal("1.50")),
)


class InMemoryOrders(InMemoryRepository[Order]):
    aggregate_name = "order"


class InMemoryOrderSummaries:
    """The read model's port, kept in a dict (a fake needs no more than the port asks)."""

    def __init__(self) -> None:
        self.rows: dict[str, OrderSummary] = {}

    async def get(self, order_id: str) -> OrderSummary | None:
        return self.rows.get(order_id)

    def save(self, summary: OrderSummary) -> None:
        self.rows[summary.order_id] = summary


@pytest.fixture
def store() -> InMemoryStore:
    return InMemoryStore()


@pytest.fixture
def summaries() -> InMemoryOrderSummaries:
    return InMemoryOrderSummaries()


@pytest.fixture
def uow(store: InMemoryStore, summaries: InMemoryOrderSummaries) -> InMemoryUnitOfWork:
    return unit_of_work(store, summaries)


def unit_of_work(store: InMemoryStore, summaries: InMemoryOrderSummaries) -> InMemoryUnitOfWork:
    return InMemoryUnitOfWork(store, adapters={Orders: InMemoryOrders, OrderSummaries: lambda _: summaries})


async def test_placing_an_order_saves_it_and_schedules_the_customer_count(
    store: InMemoryStore, uow: InMemoryUnitOfWork
) -> None:
    with acting_as("acme"):
        async with uow:
            order = await place_order(uow, PlaceOrder(customer_id="c-1", lines=LINES))
            assert store.commits == 0  # nothing is saved before the caller commits
            await uow.commit()

    assert [type(event) for event in store.events] == [OrderPlaced]
    ((command, due_at),) = store.scheduled
    assert isinstance(command, CountCustomerOrder)
    assert (command.tenant_id, command.customer_id, command.order_id, due_at) == (
        "acme",
        "c-1",
        order.id,
        None,
    )
    assert store.published == []  # the integration event is the handler's job, not the use case's


async def test_an_order_is_cancelled_once_and_only_in_its_tenant(
    store: InMemoryStore, summaries: InMemoryOrderSummaries
) -> None:
    with acting_as("acme"):
        placed = await unit_of_work(store, summaries).run(
            lambda uow: place_order(uow, PlaceOrder(customer_id="c-1", lines=LINES))
        )
    with acting_as("globex"), pytest.raises(NotFoundError):
        await unit_of_work(store, summaries).run(lambda uow: cancel_order(uow, placed.id, "not mine"))
    with acting_as("acme"):
        cancelled = await unit_of_work(store, summaries).run(
            lambda uow: cancel_order(uow, placed.id, "changed my mind")
        )

    assert (cancelled.status, cancelled.version) == (OrderStatus.CANCELLED, 2)
    assert [type(event) for event in store.events] == [OrderPlaced, OrderCancelled]


async def test_the_placed_handlers_project_once_and_announce_the_integration_event(
    store: InMemoryStore, summaries: InMemoryOrderSummaries
) -> None:
    event = Order.place("o-1", tenant_id="acme", customer_id="c-1", lines=LINES).pending_events[0]
    assert isinstance(event, OrderPlaced)
    for _ in range(2):  # a redelivery after a lost stamp projects nothing twice
        async with unit_of_work(store, summaries) as uow:
            await project_order_placed(event, uow)
            await uow.commit()
    async with unit_of_work(store, summaries) as uow:
        await announce_order_placed(event, uow)
        await uow.commit()

    summary = summaries.rows["o-1"]
    assert (summary.status, summary.line_count, summary.total, summary.events_applied) == (
        "placed",
        2,
        Decimal("21.48"),
        1,
    )
    (announced,) = store.published
    assert isinstance(announced, OrderPlacedV1)
    assert (announced.order_id, announced.customer_id, announced.total) == ("o-1", "c-1", "21.48")
