"""The example's per-customer order counter under concurrent deliveries (PostgreSQL).

The internal-command processor delivers up to ``OUTBOX__DELIVERY_CONCURRENCY`` commands at
once, each in a unit of work of its own. A counter kept by read, add one, write loses every
increment whose read raced another delivery (50 orders once left it at 13): the example must
show the safe way, because users copy it.
"""

from __future__ import annotations

from decimal import Decimal

import pytest
import sqlalchemy as sa
from outbox_kit.testing import COMMAND_TABLE
from outbox_kit.testing.fixtures import acting_as, fetch, make_settings
from outbox_kit.testing.harness import command_source
from sqlmodel import select

from {{ cookiecutter.package_name }}.container import (
    build_container,
)
from {{ cookiecutter.package_name }}.contexts.orders import (
    application,
)
from {{ cookiecutter.package_name }}.contexts.orders.domain import (
    OrderLine,
)
from {{ cookiecutter.package_name }}.contexts.orders.tables import (
    CustomerStatisticsRow,
)

pytestmark = [pytest.mark.integration, pytest.mark.postgres]
ORDERS = 50


async def test_concurrent_deliveries_count_every_order_of_one_customer(postgres_url: str) -> None:
    container = build_container(
        make_settings(
            postgres_url,
            outbox={"delivery_concurrency": 25, "retry_backoff_base_seconds": 0.05},
            database={"pool_size": 25},
        )
    )
    command = application.PlaceOrder("c-1", (OrderLine("BOOK", 1, Decimal("5.00")),))
    try:
        with acting_as():
            for _ in range(ORDERS):
                await container.units_of_work()().run(lambda uow: application.place_order(uow, command))
        commands = command_source(container)
        for _ in range(200):  # failed deliveries come back after their (short) backoff
            await commands.run_cycle()
            pending = await fetch(
                container,
                sa.select(COMMAND_TABLE.c.id).where(
                    COMMAND_TABLE.c.processed_on.is_(None), COMMAND_TABLE.c.dead_lettered_on.is_(None)
                ),
            )
            if not pending:
                break
        counted = await fetch(container, select(CustomerStatisticsRow))
        done = await fetch(
            container, sa.select(COMMAND_TABLE.c.id).where(COMMAND_TABLE.c.processed_on.is_not(None))
        )
    finally:
        await container.database().dispose()
    assert len(done) == ORDERS
    assert [(c.tenant_id, c.customer_id, c.orders_placed) for c in counted] == [("acme", "c-1", ORDERS)]
