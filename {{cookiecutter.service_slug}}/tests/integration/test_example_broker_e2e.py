"""The example end to end across a real broker: order placed over HTTP -> outbox -> broker ->
notifications consumer -> inbox -> notification visible via the API, with the caller's tenant,
user and correlation (they can only arrive through the signed headers)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from {{ cookiecutter.package_name }}.container import (
    build_container,
)

from ..conftest import SERVICE_URLS, live_server, make_settings, token_for

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    "transport",
    [
        pytest.param("rabbitmq", marks=pytest.mark.rabbitmq),
        pytest.param("kafka", marks=pytest.mark.kafka),
        pytest.param("nats", marks=pytest.mark.nats),
        pytest.param("redis", marks=pytest.mark.redis),
    ],
)
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
                    json={
                        "customer_id": "c-9",
                        "lines": [{"sku": "PEN", "quantity": 3, "unit_price": "1.50"}],
                    },
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
    assert [(n["event_name"], n["tenant_id"], n["user_id"], n["correlation_id"]) for n in found] == [
        ("orders.order-placed.v1", "acme", "alice", "e2e-1")
    ]
    assert foreign == []
