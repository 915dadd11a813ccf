"""The HTTP edge: how large a request may be, what a refusal echoes, and text that no database
stores the same way (NUL, unpaired surrogates), on SQLite and PostgreSQL.

The probe router stands for a context a user adds later: it stores one string through the unit
of work, so these tests prove the edge covers routes it has never heard of. No
``from __future__ import annotations`` here: FastAPI reads the probe's annotations.
"""

import asyncio
import contextlib
import json
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any
from urllib.parse import urlparse

import httpx
import jwt
import pytest
from fastapi import APIRouter, Depends, status
from outbox_kit.application.context import (
    RequestContext,
)
from outbox_kit.persistence.unit_of_work import SqlUnitOfWork, SqlUnitOfWorkFactory
from outbox_kit.runtime.container import OutboxContainer
from outbox_kit.runtime.http import authenticated, units_of_work
from outbox_kit.testing.fixtures import live_server, token_for
from outbox_kit.testing.harness import install_kit, record_effect
from pydantic import BaseModel, Field

pytestmark = pytest.mark.integration
MIB = 1024 * 1024
Caller = Annotated[RequestContext, Depends(authenticated)]
Units = Annotated[SqlUnitOfWorkFactory, Depends(units_of_work)]


class ProbeIn(BaseModel):
    label: str = Field(max_length=200)


async def store(units: SqlUnitOfWorkFactory, label: str) -> dict[str, str]:
    async def operation(uow: SqlUnitOfWork) -> None:
        await record_effect(uow, label)

    await units().run(operation)
    return {"label": label}


def probe_router() -> APIRouter:
    """A route of each kind: a JSON body, a path parameter and a query parameter."""
    router = APIRouter(prefix="/probe")

    @router.post("", status_code=status.HTTP_201_CREATED)
    async def from_body(body: ProbeIn, _caller: Caller, units: Units) -> dict[str, str]:
        return await store(units, body.label)

    @router.post("/{label}", status_code=status.HTTP_201_CREATED)
    async def from_path(label: str, _caller: Caller, units: Units) -> dict[str, str]:
        return await store(units, label)

    @router.put("", status_code=status.HTTP_201_CREATED)
    async def from_query(label: str, _caller: Caller, units: Units) -> dict[str, str]:
        return await store(units, label)

    return router


def auth(container: OutboxContainer, **claims: Any) -> dict[str, str]:
    return {"Authorization": f"Bearer {token_for(container, **claims)}"}


async def status_line(reader: asyncio.StreamReader) -> int:
    line = await reader.readline()
    return int(line.split()[1])


async def raw_request(base: str, head: str, chunks: Iterable[bytes] = ()) -> tuple[int, int]:
    """Send ``head`` and then ``chunks`` while reading the answer: (status, body bytes sent before
    the answer came). Stops sending as soon as the server answers or closes."""
    url = urlparse(base)
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    answer = asyncio.create_task(status_line(reader))
    sent = 0
    try:
        writer.write(head.encode())
        await writer.drain()
        for chunk in chunks:
            if answer.done():
                break
            try:
                writer.write(chunk)
                await writer.drain()
            except ConnectionError:
                break
            sent += len(chunk)
            await asyncio.sleep(0.01)  # a paced client; the server shares this event loop
        return await asyncio.wait_for(answer, 10), sent
    finally:
        answer.cancel()
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


def post_head(container: OutboxContainer, *extra: str) -> str:
    lines = ["POST /probe HTTP/1.1", "Host: test", "Content-Type: application/json", *extra]
    return "\r\n".join([*lines, *(f"{k}: {v}" for k, v in auth(container).items())]) + "\r\n\r\n"


async def test_a_declared_length_over_the_limit_is_refused_before_any_body_arrives(
    container: OutboxContainer,
) -> None:
    await install_kit(container)
    async with live_server(container, with_worker=False, routers=[probe_router()]) as base:
        code, _ = await raw_request(base, post_head(container, f"Content-Length: {MIB + 1}"))
    assert code == 413


async def test_a_chunked_body_is_counted_as_it_streams(container: OutboxContainer) -> None:
    """No Content-Length: the edge counts while the body arrives and answers once it passes the
    limit, without waiting for the rest (the client here would send 4 MiB and never finish)."""
    await install_kit(container)
    chunk = b"x" * 65536
    framed = (f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n" for _ in range(64))
    async with live_server(container, with_worker=False, routers=[probe_router()]) as base:
        code, sent = await raw_request(base, post_head(container, "Transfer-Encoding: chunked"), framed)
    assert code == 413
    assert sent < 3 * MIB  # answered near the limit, not after the whole stream


async def test_the_limit_is_a_setting(make_container: Any) -> None:
    container = make_container(api={"max_body_bytes": 1000})
    await install_kit(container)
    async with (
        live_server(container, with_worker=False, routers=[probe_router()]) as base,
        httpx.AsyncClient(base_url=base, headers=auth(container)) as client,
    ):
        small = await client.post("/probe", json={"label": "x" * 100})
        large = await client.post("/probe", content=json.dumps({"label": "x" * 1000}))
    assert (small.status_code, large.status_code) == (201, 413)


async def test_a_body_that_trickles_in_is_408_within_the_body_time_limit(make_container: Any) -> None:
    """A client sending its body a byte at a time held the request (and its task) for ever: the
    edge answers 408 once API__BODY_READ_TIMEOUT_SECONDS has passed, and a normal body passes.
    (The request head's time limit, the server's, is tests/integration/test_slow_clients.py's.)"""
    container = make_container(api={"body_read_timeout_seconds": 0.5})
    await install_kit(container)
    trickle = (b" " for _ in range(1000))  # one byte every 10 ms: 10 s for the whole body
    async with live_server(container, with_worker=False, routers=[probe_router()]) as base:
        code, sent = await raw_request(base, post_head(container, "Content-Length: 1000"), trickle)
        async with httpx.AsyncClient(base_url=base, headers=auth(container)) as client:
            normal = await client.post("/probe", json={"label": "on time"})
    assert code == 408
    assert sent < 1000
    assert normal.status_code == 201


async def test_a_head_that_trickles_in_is_cut_within_the_header_time_limit(make_container: Any) -> None:
    """uvicorn has no time limit for a request head: a header sent a byte at a time held the
    connection for ever. The server now answers 408 and closes once
    API__HEADER_READ_TIMEOUT_SECONDS has passed since the head began."""
    container = make_container(api={"header_read_timeout_seconds": 0.5})
    async with live_server(container, with_worker=False) as base:
        trickle = (b"a" for _ in range(1000))  # one byte every 10 ms: 10 s for the whole header
        code, sent = await raw_request(base, "GET /livez HTTP/1.1\r\nX-Slow: ", trickle)
        async with httpx.AsyncClient(base_url=base) as client:
            normal = await client.get("/livez")
    assert code == 408
    assert sent < 1000
    assert normal.status_code == 200


async def test_a_refused_value_is_echoed_as_a_short_prefix(container: OutboxContainer) -> None:
    """A body just under the limit with one huge invalid value: the 422 names the field and
    shows the start of the value, not the megabyte."""
    await install_kit(container)
    async with (
        live_server(container, with_worker=False, routers=[probe_router()]) as base,
        httpx.AsyncClient(base_url=base, headers=auth(container)) as client,
    ):
        answer = await client.post("/probe", json={"label": "x" * (MIB - 100)})
        missing = await client.post("/probe", json={"other": "y" * (MIB - 100)})
    assert answer.status_code == 422
    assert len(answer.content) < 1024
    (error,) = answer.json()["detail"]
    assert error["loc"] == ["body", "label"]
    assert error["input"].startswith("xxxx")
    assert len(error["input"]) <= 80
    assert missing.status_code == 422  # the whole body is the "input" of a missing field
    assert len(missing.content) < 1024


def long_token(container: OutboxContainer, length: int) -> str:
    """A correctly signed admin token padded to about ``length`` characters."""
    secret = container.settings().auth.jwt_secret.get_secret_value()
    now = datetime.now(UTC)
    claims = {"sub": "mallory", "tenant": "acme", "roles": ["outbox-admin"], "iat": now}
    return jwt.encode(
        {**claims, "exp": now + timedelta(minutes=5), "pad": "p" * length}, secret, algorithm="HS256"
    )


async def test_an_over_long_token_is_refused_without_being_decoded(
    container: OutboxContainer, monkeypatch: pytest.MonkeyPatch
) -> None:
    decoded: list[int] = []
    real_decode = jwt.decode

    def spy(token: str, *args: Any, **kwargs: Any) -> Any:
        decoded.append(len(token))
        return real_decode(token, *args, **kwargs)

    monkeypatch.setattr(jwt, "decode", spy)
    token = long_token(container, 12_000)  # over 8 KiB, under the HTTP server's own header limit
    async with live_server(container, with_worker=False) as base, httpx.AsyncClient(base_url=base) as client:
        answer = await client.get("/admin/outbox/pending", headers={"Authorization": f"Bearer {token}"})
        normal = await client.get("/admin/outbox/pending", headers=auth(container, roles=("outbox-admin",)))
    assert answer.status_code == 401
    assert "longer than 8192 characters" in answer.json()["detail"]
    assert normal.status_code == 200
    assert decoded, "the spy saw no token at all"
    assert len(token) not in decoded


async def test_a_token_whose_times_are_not_integers_is_401(container: OutboxContainer) -> None:
    """PyJWT reads exp with int(): "9999999999" and 1e308 (a token that never expires) passed."""
    secret = container.settings().auth.jwt_secret.get_secret_value()
    now = int(datetime.now(UTC).timestamp())
    claims = {"sub": "mallory", "tenant": "acme", "roles": ["outbox-admin"], "iat": now}
    tokens = {
        "string": jwt.encode({**claims, "exp": str(now + 300)}, secret, algorithm="HS256"),
        "1e308": jwt.encode({**claims, "exp": 1e308}, secret, algorithm="HS256"),
        "fraction": jwt.encode({**claims, "exp": now + 300.5}, secret, algorithm="HS256"),
        "integer": jwt.encode({**claims, "exp": now + 300}, secret, algorithm="HS256"),
    }
    async with live_server(container, with_worker=False) as base, httpx.AsyncClient(base_url=base) as client:
        answers = {
            name: await client.get("/admin/outbox/pending", headers={"Authorization": f"Bearer {token}"})
            for name, token in tokens.items()
        }
    assert {name: a.status_code for name, a in answers.items()} == {
        "string": 401,
        "1e308": 401,
        "fraction": 401,
        "integer": 200,
    }
    assert "'exp' must be an integer" in answers["1e308"].json()["detail"]


UNSTORABLE = {
    "NUL in a JSON string": ("POST", "/probe", '{"label": "a\\u0000b"}'),
    "lone high surrogate": ("POST", "/probe", '{"label": "\\ud800"}'),
    "lone low surrogate after text": ("POST", "/probe", '{"label": "ok\\uDC00"}'),
    "surrogate as raw bytes": ("POST", "/probe", b'{"label": "\xed\xa0\x80"}'),
    "NUL in a key": ("POST", "/probe", '{"label": "x", "\\u0000": 1}'),
    "NUL in the path": ("POST", "/probe/a%00b", None),
    "NUL in the query": ("PUT", "/probe?label=a%00b", None),
}


@pytest.mark.parametrize("case", UNSTORABLE)
async def test_text_no_database_stores_alike_is_422_on_every_database(
    container: OutboxContainer, case: str
) -> None:
    """SQLite stored these and PostgreSQL failed with 500: both now refuse them at the edge,
    before any handler runs, for every route (the probe is unknown to the edge)."""
    kit = await install_kit(container)
    method, path, body = UNSTORABLE[case]
    headers = auth(container) | {"Content-Type": "application/json"}
    async with (
        live_server(container, with_worker=False, routers=[probe_router()]) as base,
        httpx.AsyncClient(base_url=base, headers=headers) as client,
    ):
        answer = await client.request(method, path, content=body)
    assert answer.status_code == 422, answer.text
    assert "NUL" in answer.json()["detail"][0]["msg"]
    assert await kit.effects() == []


async def test_escapes_that_look_alike_but_are_valid_text_pass(container: OutboxContainer) -> None:
    """A surrogate *pair* is one character (an emoji), and an escaped backslash before ``u0000``
    is the literal text ``\\u0000``: both are ordinary strings and are stored."""
    kit = await install_kit(container)
    async with (
        live_server(container, with_worker=False, routers=[probe_router()]) as base,
        httpx.AsyncClient(base_url=base, headers=auth(container)) as client,
    ):
        as_json = {"Content-Type": "application/json"}
        pair = await client.post("/probe", content='{"label": "smile \\ud83d\\ude00"}', headers=as_json)
        literal = await client.post("/probe", content='{"label": "\\\\u0000"}', headers=as_json)
        plain = await client.put("/probe", params={"label": "caf\u00e9 50%"})
    assert [a.status_code for a in (pair, literal, plain)] == [201, 201, 201]
    assert await kit.effects() == ["smile \U0001f600", "\\u0000", "caf\u00e9 50%"]


NON_FINITE = ("NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1" + "0" * 400 + ".5")
# Routes that take a JSON body, each with a body that would otherwise pass, and where a number
# goes: {number} is replaced by each non-finite literal (a field's value, a list item, a field
# the model does not know). The example's own routes are tests/integration/test_example_orders_api.py's.
BODIES = {
    "/admin/outbox/dead-letters/replay": '{"ids": [{number}]}',
    "/probe": '{"label": "x", "deep": {"list": [0, {number}]}}',
    "/no-such-route": '{"n": {number}}',
}


async def test_non_finite_numbers_anywhere_in_a_json_body_are_422_on_every_database(
    container: OutboxContainer,
) -> None:
    """Python's JSON parser reads NaN, Infinity and 1e400 (as inf), and the 422 that echoed the
    value could not encode it: a 500 and a traceback. The edge refuses them on every route that
    takes a body, before any route parses it; the same words inside a string are text and pass."""
    kit = await install_kit(container)
    headers = auth(container, roles=("outbox-admin",)) | {"Content-Type": "application/json"}
    answers: dict[tuple[str, str], tuple[int, str]] = {}
    async with (
        live_server(container, with_worker=False, routers=[probe_router()]) as base,
        httpx.AsyncClient(base_url=base, headers=headers) as client,
    ):
        for route, body in BODIES.items():
            for number in NON_FINITE:
                answer = await client.post(route.partition("?")[0], content=body.replace("{number}", number))
                answers[route, number] = (answer.status_code, answer.text)
        as_text = await client.post("/probe", content='{"label": "NaN Infinity 1e400"}')
        finite = await client.post("/probe", content='{"label": "y", "extra": [1e300, -1e-400, 1e-5]}')
    refused = {key: status for key, (status, _) in answers.items() if status == 422}
    assert refused.keys() == answers.keys(), {k: v for k, v in answers.items() if k not in refused}
    assert "non-finite" in answers["/probe", "NaN"][1]
    assert "Traceback" not in "".join(text for _, text in answers.values())
    assert (as_text.status_code, finite.status_code) == (201, 201)
    assert await kit.effects() == ["NaN Infinity 1e400", "y"]


async def test_an_offset_past_any_page_is_422_on_every_database(container: OutboxContainer) -> None:
    headers = auth(container, roles=("outbox-admin",))
    async with (
        live_server(container, with_worker=False) as base,
        httpx.AsyncClient(base_url=base, headers=headers) as client,
    ):
        huge = await client.get("/admin/outbox/dead-letters", params={"offset": 2**63})
        largest = await client.get("/admin/outbox/dead-letters", params={"offset": 2**63 - 1})
        fine = await client.get("/admin/outbox/dead-letters", params={"offset": 10_000})
    assert (huge.status_code, largest.status_code, fine.status_code) == (422, 422, 200)
