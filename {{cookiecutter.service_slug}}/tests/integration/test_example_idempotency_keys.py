"""``Idempotency-Key`` on ``POST /orders`` (a create command), on SQLite and PostgreSQL, through a
real server: a retried request creates one order and answers the first answer; the same key
with another body is 422; keys belong to a tenant; identical requests sent at once create
exactly one order and all get the same answer; the key and the order commit together."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from datetime import timedelta
from decimal import Decimal
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from {{ cookiecutter.package_name }}.building_blocks.application.unit_of_work import (
    UnitOfWork,
)
from {{ cookiecutter.package_name }}.building_blocks.idempotency.keys import (
    Answer,
    IdempotencyKey,
    run_once,
)
from {{ cookiecutter.package_name }}.building_blocks.persistence.audit_tables import (
    IDEMPOTENCY_KEYS_TABLE,
)
from {{ cookiecutter.package_name }}.building_blocks.persistence.tables import (
    OUTBOX_TABLE,
)
from {{ cookiecutter.package_name }}.container import (
    Container,
)
from {{ cookiecutter.package_name }}.contexts.orders import (
    application,
)
from {{ cookiecutter.package_name }}.contexts.orders.domain import (
    Order,
    OrderLine,
)
from {{ cookiecutter.package_name }}.contexts.orders.tables import (
    ORDERS,
)

from ..conftest import ContainerFactory, acting_as, fetch, live_server, token_for

pytestmark = pytest.mark.integration
ORDER = {"customer_id": "c-1", "lines": [{"sku": "BOOK", "quantity": 2, "unit_price": "9.99"}]}
CONCURRENT = 12


def headers(container: Container, key: str | None, tenant: str = "acme") -> dict[str, str]:
    found = {"Authorization": f"Bearer {token_for(container, tenant, 'alice')}"}
    return found | ({"Idempotency-Key": key} if key is not None else {})


async def orders_of(container: Container) -> list[Any]:
    return await fetch(container, sa.select(ORDERS.c.id, ORDERS.c.tenant_id))


async def keys_of(container: Container) -> list[Any]:
    return await fetch(container, sa.select(IDEMPOTENCY_KEYS_TABLE))


async def test_a_retried_post_with_the_same_key_answers_the_first_answer_and_places_one_order(
    container: Container,
) -> None:
    async with live_server(container) as base, httpx.AsyncClient(base_url=base) as client:
        first = await client.post("/orders", json=ORDER, headers=headers(container, "k-1"))
        # The same body, its keys in another order: the same request.
        again = await client.post(
            "/orders", json={"lines": ORDER["lines"], "customer_id": "c-1"}, headers=headers(container, "k-1")
        )
        plain = await client.post("/orders", json=ORDER, headers=headers(container, None))
    assert (first.status_code, again.status_code, plain.status_code) == (201, 201, 201)
    assert again.content == first.content
    assert again.headers["Idempotent-Replayed"] == "true"
    assert "Idempotent-Replayed" not in first.headers
    placed_ids = sorted([first.json()["id"], plain.json()["id"]])
    assert sorted(o.id for o in await orders_of(container)) == placed_ids
    assert first.json()["version"] == plain.json()["version"] == 1  # the saved version, as without a key
    # One order's events: the retry wrote no outbox row.
    placed = await fetch(
        container,
        sa.select(OUTBOX_TABLE.c.id).where(OUTBOX_TABLE.c.event_name == "orders.domain.order-placed.v1"),
    )
    assert len(placed) == 2


async def test_the_same_key_with_another_body_is_422_and_places_nothing(container: Container) -> None:
    async with live_server(container) as base, httpx.AsyncClient(base_url=base) as client:
        first = await client.post("/orders", json=ORDER, headers=headers(container, "k-1"))
        other = await client.post(
            "/orders", json={**ORDER, "customer_id": "c-2"}, headers=headers(container, "k-1")
        )
    assert first.status_code == 201
    assert other.status_code == 422
    assert other.json()["code"] == "idempotency_key_reused"
    assert [o.id for o in await orders_of(container)] == [first.json()["id"]]


async def test_keys_belong_to_a_tenant(container: Container) -> None:
    async with live_server(container) as base, httpx.AsyncClient(base_url=base) as client:
        acme = await client.post("/orders", json=ORDER, headers=headers(container, "k-1", "acme"))
        globex = await client.post("/orders", json=ORDER, headers=headers(container, "k-1", "globex"))
        globex_other = await client.post(
            "/orders", json={**ORDER, "customer_id": "c-9"}, headers=headers(container, "k-2", "globex")
        )
        acme_other = await client.post(
            "/orders", json={**ORDER, "customer_id": "c-9"}, headers=headers(container, "k-2", "acme")
        )
    assert [r.status_code for r in (acme, globex, globex_other, acme_other)] == [201, 201, 201, 201]
    assert acme.json()["id"] != globex.json()["id"]
    assert (acme.json()["tenant_id"], globex.json()["tenant_id"]) == ("acme", "globex")
    assert "Idempotent-Replayed" not in globex.headers
    assert len(await orders_of(container)) == 4


async def test_identical_requests_sent_at_once_place_one_order_and_get_one_answer(
    container: Container,
) -> None:
    async with live_server(container) as base, httpx.AsyncClient(base_url=base, timeout=60) as client:
        answers = await asyncio.gather(
            *(
                client.post("/orders", json=ORDER, headers=headers(container, "checkout-42"))
                for _ in range(CONCURRENT)
            )
        )
    assert [a.status_code for a in answers] == [201] * CONCURRENT, [a.text for a in answers]
    assert len({a.content for a in answers}) == 1
    assert [o.id for o in await orders_of(container)] == [answers[0].json()["id"]]
    assert len([a for a in answers if "Idempotent-Replayed" not in a.headers]) == 1


async def test_a_failed_command_records_no_key_so_its_retry_runs(container: Container) -> None:
    """The key row is written in the command's transaction: when the command fails after the
    key was taken, both roll back (no key without its order, no order without its key), and the
    retry with the same key runs the command."""
    key = IdempotencyKey("k-1", "POST /orders")
    command = application.PlaceOrder("c-1", (OrderLine("BOOK", 1, Decimal("5.00")),))

    async def fails_after_placing(uow: UnitOfWork) -> Order:
        await application.place_order(uow, command)
        msg = "the process died here"
        raise RuntimeError(msg)

    async def places(uow: UnitOfWork) -> Order:
        return await application.place_order(uow, command)

    def once(operation: Callable[[UnitOfWork], Awaitable[Order]]) -> Awaitable[Answer]:
        return run_once(
            container.units_of_work(),
            operation,
            present=lambda order: {"id": order.id, "version": order.version},
            key=key,
            request={"customer_id": "c-1"},
            status_code=201,
        )

    with acting_as():
        with pytest.raises(RuntimeError, match="the process died here"):
            await once(fails_after_placing)
        assert (await keys_of(container), await orders_of(container)) == ([], [])
        placed = await once(places)
        again = await once(fails_after_placing)  # answered from the key: not run
    (order,) = await orders_of(container)
    assert json.loads(placed.body) == {"id": order.id, "version": 1}
    assert (again.body, again.replayed, placed.replayed) == (placed.body, True, False)
    (row,) = await keys_of(container)
    assert (row.tenant_id, row.key, row.status_code, row.response_body) == ("acme", "k-1", 201, placed.body)


@pytest.mark.parametrize("key", ["", "a b", "x" * 256, "caf\u00e9"])
async def test_a_malformed_key_is_422(container: Container, key: str) -> None:
    async with live_server(container, with_worker=False) as base, httpx.AsyncClient(base_url=base) as client:
        answer = await client.post(
            "/orders",
            json=ORDER,
            headers={  # as UTF-8 bytes: httpx would send a str as ASCII
                b"Authorization": f"Bearer {token_for(container)}".encode(),
                b"Idempotency-Key": key.encode(),
            },
        )
    assert answer.status_code == 422
    assert answer.json()["detail"][0]["loc"] == ["header", "Idempotency-Key"]
    assert await orders_of(container) == []


async def test_keys_are_purged_after_their_retention(make_container: ContainerFactory) -> None:
    container = make_container(api={"idempotency_key_retention_hours": 2})
    now = container.clock()()
    async with container.database().session() as session:
        await session.exec(
            sa.insert(IDEMPOTENCY_KEYS_TABLE).values(
                [
                    {"tenant_id": "acme", "key": key, "fingerprint": "f", "created_on": at}
                    for key, at in (("old", now - timedelta(hours=3)), ("young", now - timedelta(hours=1)))
                ]
            )
        )
        await session.commit()
    counts = await container.cleaner().sweep()
    assert counts["idempotency_keys:expired"] == 1
    assert [k.key for k in await keys_of(container)] == ["young"]
