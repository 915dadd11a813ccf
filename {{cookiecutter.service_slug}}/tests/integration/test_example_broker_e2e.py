"""The example end to end across a real broker: order placed over HTTP -> outbox -> broker ->
notifications consumer -> inbox -> notification visible via the API, with the caller's tenant,
user and correlation (they can only arrive through the signed headers)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from outbox_kit.testing.fixtures import SERVICE_URLS, live_server, make_settings, token_for

from {{ cookiecutter.package_name }}.container import (
    build_container,
)

pytestmark = pytest.mark.integration


TRANSPORTS = [
    pytest.param("rabbitmq", marks=pytest.mark.rabbitmq),
    pytest.param("kafka", marks=pytest.mark.kafka),
    pytest.param("nats", marks=pytest.mark.nats),
    pytest.param("redis", marks=pytest.mark.redis),
]
ORDER = {"customer_id": "c-9", "lines": [{"sku": "PEN", "quantity": 3, "unit_price": "1.50"}]}


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_an_order_reaches_the_notifications_context_through_the_broker(
    database_url: str, transport: str
) -> None:
    container = build_container(
        make_settings(database_url, message_bus={"transport": transport, "url": SERVICE_URLS[transport]})
    )
    headers = {
        "Authorization": f"Bearer {token_for(container, 'acme', 'alice')}",
        "X-Correlation-Id": "e2e-1",
    }
    try:
        async with live_server(container) as base, httpx.AsyncClient(base_url=base) as client:
            order = (
                await client.post(
                    "/orders",
                    headers=headers,
                    json=ORDER,
                )
            ).json()
            found: list[dict[str, str]] = []
            for _ in range(300):
                found = (await client.get(f"/notifications?order_id={order['id']}", headers=headers)).json()
                if found:
                    break
                await asyncio.sleep(0.05)
            foreign = (
                await client.get(
                    f"/notifications?order_id={order['id']}",
                    headers={"Authorization": f"Bearer {token_for(container, 'globex', 'eve')}"},
                )
            ).json()
    finally:
        await container.bus().delete_topology()  # type: ignore[attr-defined]  # leave the broker clean
        await container.database().dispose()
    ours = [n for n in found if n["event_name"].startswith("orders.")]  # not a later context's
    assert [(n["event_name"], n["tenant_id"], n["user_id"], n["correlation_id"]) for n in ours] == [
        ("orders.order-placed.v1", "acme", "alice", "e2e-1")
    ]
    assert foreign == []


# "\u00fc" is 2 bytes in UTF-8: at the limits of x-tenant-id (64), x-user-id (128) and
# x-user-roles (512 bytes: 255 + "," + 256), in half as many characters.
TENANT, USER = "\u00fc" * 32, "\u00fc" * 64
ROLES = ("\u00fc" * 127 + "a", "\u00fc" * 127 + "bc")


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_identities_at_the_byte_limit_are_consumed_and_one_byte_more_is_401(
    database_url: str, transport: str
) -> None:
    """The API bounded identities in characters and the consumers in bytes: a tenant of 40
    "\u00fc" (80 bytes) was 201, and every consumer dead-lettered its events (oversized_header).
    Now one limit in bytes: over it the token is 401 and nothing is written; exactly at it the
    event crosses the broker and is consumed, and the columns that store it hold it."""
    container = build_container(
        make_settings(database_url, message_bus={"transport": transport, "url": SERVICE_URLS[transport]})
    )
    over = {
        "tenant": token_for(container, "\u00fc" * 40, USER, ROLES),
        "user": token_for(container, TENANT, "\u00fc" * 65, ROLES),
        "roles": token_for(container, TENANT, USER, (ROLES[0], ROLES[1] + "d")),
    }
    at_limit = {"Authorization": f"Bearer {token_for(container, TENANT, USER, ROLES)}"}
    try:
        async with live_server(container) as base, httpx.AsyncClient(base_url=base) as client:
            refused = {
                name: await client.post("/orders", headers={"Authorization": f"Bearer {token}"}, json=ORDER)
                for name, token in over.items()
            }
            placed = await client.post("/orders", headers=at_limit, json=ORDER)
            found: list[dict[str, str]] = []
            for _ in range(300):
                found = (
                    await client.get(f"/notifications?order_id={placed.json()['id']}", headers=at_limit)
                ).json()
                if found:
                    break
                await asyncio.sleep(0.05)
    finally:
        await container.bus().delete_topology()  # type: ignore[attr-defined]  # leave the broker clean
        await container.database().dispose()
    assert {name: answer.status_code for name, answer in refused.items()} == dict.fromkeys(over, 401)
    assert all("bytes in UTF-8" in answer.json()["detail"] for answer in refused.values())
    assert placed.status_code == 201, placed.text
    ours = [n for n in found if n["event_name"].startswith("orders.")]  # not a later context's
    assert [(n["tenant_id"], n["user_id"]) for n in ours] == [(TENANT, USER)]
