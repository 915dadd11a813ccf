"""The example orders API end to end on a real server: order placed over HTTP -> outbox ->
in-process bus -> consumer -> inbox -> notification visible via the API, with the caller's
tenant, user and correlation."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import httpx
import jwt
import pytest
from outbox_kit.testing.fixtures import fetch, live_server, token_for
from sqlmodel import col, select

from {{ cookiecutter.package_name }}.container import (
    Container,
)
from {{ cookiecutter.package_name }}.contexts.orders.tables import (
    CustomerStatisticsRow,
    OrderSummaryRow,
)

pytestmark = pytest.mark.integration
ORDER = {"customer_id": "c-1", "lines": [{"sku": "BOOK", "quantity": 2, "unit_price": "9.99"}]}


def auth(container: Container, tenant: str = "acme", user: str = "alice") -> dict[str, str]:
    return {"Authorization": f"Bearer {token_for(container, tenant, user)}"}


ORDERS_EVENTS = "orders."  # the names of the orders context's integration events


async def wait_for_notifications(
    client: httpx.AsyncClient, order_id: str, headers: dict[str, str], count: int
) -> list[Any]:
    """The notifications of the orders context's own events: a context added later may record
    notifications of its own for the same order, and these tests do not count them."""
    for _ in range(200):
        found = [
            n
            for n in (await client.get(f"/notifications?order_id={order_id}", headers=headers)).json()
            if n["event_name"].startswith(ORDERS_EVENTS)
        ]
        if len(found) >= count:
            return found
        await asyncio.sleep(0.05)
    raise AssertionError(f"expected {count} notifications, got {found}")


async def test_place_read_cancel_and_see_the_notifications(container: Container) -> None:
    headers = auth(container) | {"X-Correlation-Id": "checkout-7"}
    async with live_server(container) as base, httpx.AsyncClient(base_url=base) as client:
        placed = await client.post("/orders", json=ORDER, headers=headers)
        assert placed.status_code == 201
        order = placed.json()
        assert (order["status"], order["total"], order["tenant_id"]) == ("placed", "19.98", "acme")
        assert (await client.get(f"/orders/{order['id']}", headers=headers)).json()["status"] == "placed"
        (notification,) = await wait_for_notifications(client, order["id"], headers, 1)
        assert notification["event_name"] == "orders.order-placed.v1"
        assert (notification["tenant_id"], notification["user_id"]) == ("acme", "alice")
        assert notification["correlation_id"] == "checkout-7"
        cancelled = await client.post(
            f"/orders/{order['id']}/cancel", json={"reason": "changed my mind"}, headers=headers
        )
        assert cancelled.json()["status"] == "cancelled"
        again = await client.post(f"/orders/{order['id']}/cancel", headers=headers)
        assert again.status_code == 409
        notifications = await wait_for_notifications(client, order["id"], headers, 2)
    assert [n["event_name"] for n in notifications] == ["orders.order-placed.v1", "orders.order-cancelled.v1"]
    assert len({n["message_id"] for n in notifications}) == 2


async def test_placing_and_cancelling_keep_the_read_model_and_the_customer_counter(
    container: Container,
) -> None:
    """The domain-event handlers update ``order_summaries`` in the event's own follow-up unit of
    work; the internal command counts the customer's orders in a unit of work of its own."""
    async with live_server(container) as base, httpx.AsyncClient(base_url=base) as client:
        headers = auth(container)
        first = (await client.post("/orders", json=ORDER, headers=headers)).json()
        await client.post("/orders", json=ORDER, headers=headers)
        await client.post(
            f"/orders/{first['id']}/cancel", json={"reason": "changed my mind"}, headers=headers
        )
        await wait_for_notifications(client, first["id"], headers, 2)
        for _ in range(200):
            counted = await fetch(container, select(CustomerStatisticsRow))
            if counted and counted[0].orders_placed == 2:
                break
            await asyncio.sleep(0.05)
    summary = (
        await fetch(container, select(OrderSummaryRow).where(col(OrderSummaryRow.order_id) == first["id"]))
    )[0]
    assert (summary.status, summary.line_count, summary.total, summary.events_applied) == (
        "cancelled",
        1,
        Decimal("19.98"),
        2,
    )
    assert [(c.tenant_id, c.customer_id, c.orders_placed) for c in counted] == [("acme", "c-1", 2)]


async def test_validation_errors_are_422_with_field_messages(container: Container) -> None:
    async with live_server(container, with_worker=False) as base, httpx.AsyncClient(base_url=base) as client:
        bad = await client.post(
            "/orders",
            json={"customer_id": "", "lines": [{"sku": "X", "quantity": 0, "unit_price": "-1"}]},
            headers=auth(container),
        )
        empty = await client.post("/orders", json={"customer_id": "c", "lines": []}, headers=auth(container))
    assert bad.status_code == 422
    fields = {tuple(error["loc"][1:]) for error in bad.json()["detail"]}
    assert {("customer_id",), ("lines", 0, "quantity"), ("lines", 0, "unit_price")} <= fields
    assert empty.status_code == 422


async def test_blank_text_is_refused_by_the_schema_naming_the_field(container: Container) -> None:
    """The OpenAPI document states the domain's not-blank rule (a pattern), so blank text is a
    field error like any other, and a client generated from the document knows it."""
    async with live_server(container, with_worker=False) as base, httpx.AsyncClient(base_url=base) as client:
        blank_customer = await client.post(
            "/orders", json={**ORDER, "customer_id": "   "}, headers=auth(container)
        )
        blank_sku = await client.post(
            "/orders",
            json={
                "customer_id": "c-1",
                "lines": [*ORDER["lines"], {**ORDER["lines"][0], "sku": "\u2003\x1c"}],
            },
            headers=auth(container),
        )
    assert blank_customer.status_code == 422
    assert blank_customer.json()["detail"][0]["loc"] == ["body", "customer_id"]
    assert blank_sku.status_code == 422
    (error,) = blank_sku.json()["detail"]
    assert (error["loc"], error["type"]) == (["body", "lines", 1, "sku"], "string_pattern_mismatch")


def bad_tokens(container: Container) -> dict[str, str]:
    secret = container.settings().auth.jwt_secret.get_secret_value()
    now = datetime.now(UTC)
    claims = {"sub": "alice", "tenant": "acme", "roles": [], "iat": now, "exp": now + timedelta(minutes=5)}
    return {
        "expired": jwt.encode({**claims, "exp": now - timedelta(minutes=1)}, secret, algorithm="HS256"),
        "wrong secret": jwt.encode(claims, "not-the-service-secret-" * 2, algorithm="HS256"),
        "no tenant": jwt.encode({k: claims[k] for k in claims if k != "tenant"}, secret, algorithm="HS256"),
        "unsigned": jwt.encode(claims, None, algorithm="none"),
        "garbage": "not-a-jwt",
    }


async def test_every_order_endpoint_refuses_a_bad_token_with_401(container: Container) -> None:
    async with live_server(container, with_worker=False) as base, httpx.AsyncClient(base_url=base) as client:
        order = (await client.post("/orders", json=ORDER, headers=auth(container))).json()
        for problem, token in bad_tokens(container).items():
            headers = {"Authorization": f"Bearer {token}"}
            answers = [
                await client.post("/orders", json=ORDER, headers=headers),
                await client.get(f"/orders/{order['id']}", headers=headers),
                await client.post(f"/orders/{order['id']}/cancel", headers=headers),
            ]
            assert [a.status_code for a in answers] == [401, 401, 401], problem
        still_placed = await client.get(f"/orders/{order['id']}", headers=auth(container))
    assert still_placed.json()["status"] == "placed"


async def test_unknown_other_tenant_and_anonymous_requests(container: Container) -> None:
    async with live_server(container, with_worker=False) as base, httpx.AsyncClient(base_url=base) as client:
        order = (await client.post("/orders", json=ORDER, headers=auth(container))).json()
        foreign = await client.get(f"/orders/{order['id']}", headers=auth(container, tenant="globex"))
        foreign_cancel = await client.post(
            f"/orders/{order['id']}/cancel", headers=auth(container, tenant="globex")
        )
        unknown = await client.get("/orders/does-not-exist", headers=auth(container))
        anonymous = await client.post("/orders", json=ORDER)
        still_placed = await client.get(f"/orders/{order['id']}", headers=auth(container))
    assert (foreign.status_code, foreign_cancel.status_code, unknown.status_code) == (404, 404, 404)
    assert anonymous.status_code == 401
    assert still_placed.json()["status"] == "placed"


async def test_no_order_the_schema_admits_exceeds_what_an_order_can_hold(container: Container) -> None:
    """10,000 x 9,999,999,999.99 fit each field but not the order's total (numeric(14,2)): SQLite
    stored it and PostgreSQL failed with 500. A unit price is now at most 999,999.99, so the
    largest order the schema admits (100 lines of 10,000 at that price) fits on every database."""
    line = {"sku": "GOLD", "quantity": 10_000, "unit_price": "9999999999.99"}
    async with live_server(container, with_worker=False) as base, httpx.AsyncClient(base_url=base) as client:
        too_much = await client.post(
            "/orders", json={"customer_id": "c-1", "lines": [line]}, headers=auth(container)
        )
        largest = await client.post(
            "/orders",
            json={"customer_id": "c-1", "lines": [{**line, "unit_price": "999999.99"}] * 100},
            headers=auth(container),
        )
    assert too_much.status_code == 422, too_much.text
    (error,) = too_much.json()["detail"]
    assert error["loc"] == ["body", "lines", 0, "unit_price"]
    assert largest.status_code == 201, largest.text
    assert largest.json()["total"] == "999999990000.00"


async def test_text_no_database_stores_alike_is_422_in_every_order_field(container: Container) -> None:
    """NUL and an unpaired surrogate (sent as JSON escapes) in a body field, NUL in the path."""
    headers = auth(container) | {"Content-Type": "application/json"}
    bad_customer = json.dumps({**ORDER, "customer_id": "c\u0000"})
    bad_sku = json.dumps({**ORDER, "lines": [{**ORDER["lines"][0], "sku": "\ud800"}]})
    async with live_server(container, with_worker=False) as base, httpx.AsyncClient(base_url=base) as client:
        answers = [
            await client.post("/orders", content=bad_customer, headers=headers),
            await client.post("/orders", content=bad_sku, headers=headers),
            await client.get("/orders/o%00x", headers=headers),
            await client.post("/orders/o%00x/cancel", json={"reason": "r"}, headers=headers),
        ]
    assert [a.status_code for a in answers] == [422, 422, 422, 422], [a.text for a in answers]


NON_FINITE = ("NaN", "Infinity", "-Infinity", "1e400", "1" + "0" * 400 + ".5")
ORDER_WITH_LINE = '{"customer_id": "c", "lines": [{"sku": "PEN", "quantity": QUANTITY, "unit_price": PRICE}]}'
# Each body with QUANTITY, PRICE or NUMBER where a non-finite literal goes.
NON_FINITE_BODIES = {
    "quantity": ("/orders", ORDER_WITH_LINE.replace("PRICE", '"1.50"')),
    "price": ("/orders", ORDER_WITH_LINE.replace("QUANTITY", "1")),
    "cancel": ("/orders/0123/cancel", '{"reason": "late", "extra": [1, NUMBER]}'),
}


async def test_non_finite_numbers_in_every_order_body_are_422(container: Container) -> None:
    """NaN, Infinity and 1e400 (read as inf) in an order's quantity or price, or anywhere in a
    cancellation, answered 500 with a traceback: the 422 that echoed the value could not encode
    it. The edge refuses them before the route parses the body."""
    headers = auth(container) | {"Content-Type": "application/json"}
    async with live_server(container) as base, httpx.AsyncClient(base_url=base, headers=headers) as client:
        answers = {}
        for name, (path, body) in NON_FINITE_BODIES.items():
            for number in NON_FINITE:
                filled = body.replace("QUANTITY", number).replace("PRICE", number).replace("NUMBER", number)
                answers[name, number] = await client.post(path, content=filled)
        placed = await client.post("/orders", json=ORDER)
    assert {key: answer.status_code for key, answer in answers.items()} == dict.fromkeys(answers, 422)
    assert all(answer.json()["detail"][0]["type"] == "non_finite_number" for answer in answers.values())
    assert placed.status_code == 201
