"""``Idempotency-Key`` on ``POST /orders`` (a create command), on SQLite and PostgreSQL, through a
real server: a retried request creates one order and answers the first answer; the same key
with another body is 422; keys belong to a tenant; identical requests sent at once create
exactly one order and all get the same answer. The framework piece itself (atomicity, purge) is
tested without the example in the kit's suite (the template's tests/kit/test_idempotency_keys.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from outbox_kit.testing import IDEMPOTENCY_KEYS_TABLE, OUTBOX_TABLE
from outbox_kit.testing.fixtures import fetch, live_server, token_for

from {{ cookiecutter.package_name }}.container import (
    Container,
)
from {{ cookiecutter.package_name }}.contexts.orders.tables import (
    ORDERS,
)

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
