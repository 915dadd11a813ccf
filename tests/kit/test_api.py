"""The HTTP surface that every generated service has, served by a real uvicorn server."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from urllib.parse import urlparse

import httpx
import jwt
import pytest
import sqlalchemy as sa
from fastapi import APIRouter, Depends, FastAPI
from outbox_kit.application.context import RequestContext, current_context
from outbox_kit.application.messages import (
    IntegrationEvent,
)
from outbox_kit.application.unit_of_work import UnitOfWorkFactory
from outbox_kit.domain import (
    ConcurrencyError,
    DomainError,
    NotFoundError,
)
from outbox_kit.persistence.tables import COMMAND_TABLE
from outbox_kit.runtime.app import create_app
from outbox_kit.runtime.container import OutboxContainer
from outbox_kit.runtime.errors import install_error_handlers
from outbox_kit.runtime.http import authenticated, units_of_work
from outbox_kit.testing.fixtures import (
    SERVICE_URLS,
    ContainerFactory,
    eventually,
    fetch,
    live_server,
    token_for,
)
from outbox_kit.testing.harness import RecordEffect, install_kit, tcp_proxy

pytestmark = pytest.mark.integration


async def test_health_metrics_and_asyncapi(container: OutboxContainer) -> None:
    async with live_server(container) as base, httpx.AsyncClient(base_url=base) as client:
        assert (await client.get("/livez")).json() == {"status": "ok"}
        ready = await client.get("/readyz")
        assert ready.status_code == 200
        assert ready.json()["checks"] == {"database": "ok", "bus": "ok"}
        assert "outbox_processor_heartbeat_timestamp_seconds" in (await client.get("/metrics")).text
        document = (await client.get("/asyncapi")).json()
    assert document["asyncapi"].startswith("3.")
    documented = {message["name"] for message in document["components"]["messages"].values()}
    channel_messages = {
        ref["$ref"].rpartition("/")[2]: channel["address"]
        for channel in document["channels"].values()
        for ref in channel["messages"].values()
    }
    for event in container.registry().classes(IntegrationEvent):
        assert event.message_name in documented, f"{event.message_name} has no AsyncAPI message"
        key = event.message_name.replace(".", "_").replace("-", "_")
        assert channel_messages[key].endswith(event.message_name), f"{event.message_name} has no channel"


async def test_readyz_reports_an_unreachable_database(make_container: object, tmp_path: object) -> None:
    container = make_container(database={"url": "postgresql+asyncpg://nobody@127.0.0.1:1/none"})  # type: ignore[operator]
    async with live_server(container, with_worker=False) as base, httpx.AsyncClient(base_url=base) as client:
        ready = await client.get("/readyz")
    assert ready.status_code == 503
    assert ready.json()["checks"]["database"].startswith("error:")


@pytest.mark.redis
async def test_readyz_reports_a_broker_that_stopped_answering(make_container: ContainerFactory) -> None:
    redis = urlparse(SERVICE_URLS["redis"])
    async with tcp_proxy(redis.hostname or "127.0.0.1", redis.port or 6379) as proxy:
        container = make_container(
            message_bus={"transport": "redis", "url": f"redis://127.0.0.1:{proxy.port}"}
        )
        async with live_server(container) as base, httpx.AsyncClient(base_url=base) as client:
            before = await client.get("/readyz")
            await proxy.cut()
            after = await client.get("/readyz")
    assert before.status_code == 200, before.json()
    assert after.status_code == 503
    assert after.json()["checks"]["database"] == "ok"
    assert after.json()["checks"]["bus"].startswith("error:")


async def test_correlation_id_is_echoed_generated_or_refused(container: OutboxContainer) -> None:
    async with live_server(container, with_worker=False) as base, httpx.AsyncClient(base_url=base) as client:
        echoed = await client.get("/livez", headers={"X-Correlation-Id": "req-42"})
        generated = await client.get("/livez")
        refused = await client.get("/livez", headers={"X-Correlation-Id": "x" * 65})
    assert echoed.headers["x-correlation-id"] == "req-42"
    assert len(generated.headers["x-correlation-id"]) == 32
    assert refused.status_code == 400
    assert "64 characters" in refused.json()["detail"]
    assert len(refused.headers["x-correlation-id"]) == 32  # a fresh id, not the refused one


async def test_domain_errors_map_to_stable_status_codes() -> None:
    """The mapping every bounded context relies on: 404, 409 (conflict, stale version), 422."""
    app = FastAPI()
    install_error_handlers(app)
    errors = {
        "missing": NotFoundError("order", "o-1"),
        "stale": ConcurrencyError("order", "o-1", 3),
        "conflict": DomainError("already cancelled", code="already_cancelled"),
        "invalid": DomainError("blank", code="invalid", field=("customer_id",)),
    }

    @app.get("/{case}")
    async def fail(case: str) -> None:
        raise errors[case]

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        answers = {case: await client.get(f"/{case}") for case in errors}
    assert {case: answer.status_code for case, answer in answers.items()} == {
        "missing": 404,
        "stale": 409,
        "conflict": 409,
        "invalid": 422,
    }
    assert answers["stale"].json()["code"] == "concurrency_conflict"
    assert "reload it and try again" in answers["stale"].json()["detail"]
    assert answers["invalid"].json()["detail"][0]["loc"] == ["body", "customer_id"]


async def test_admin_needs_a_token_and_the_admin_role(container: OutboxContainer) -> None:
    async with live_server(container, with_worker=False) as base, httpx.AsyncClient(base_url=base) as client:
        anonymous = await client.get("/admin/outbox/pending")
        bad = await client.get("/admin/outbox/pending", headers={"Authorization": "Bearer not-a-jwt"})
        clerk = await client.get(
            "/admin/outbox/pending",
            headers={"Authorization": f"Bearer {token_for(container, roles=('clerk',))}"},
        )
        admin_headers = {"Authorization": f"Bearer {token_for(container, roles=('outbox-admin',))}"}
        admin = await client.get("/admin/outbox/pending", headers=admin_headers)
        unknown = await client.get("/admin/outbox/dead-letters?source=nope", headers=admin_headers)
        missing = await client.get(
            "/admin/outbox/outbox/00000000-0000-0000-0000-000000000000/explain", headers=admin_headers
        )
    assert (anonymous.status_code, bad.status_code, clerk.status_code, admin.status_code) == (
        401,
        401,
        403,
        200,
    )
    assert "invalid bearer token" in bad.json()["detail"]
    assert [c["source"] for c in admin.json()] == ["outbox", "internal_commands"]
    assert unknown.status_code == 422  # the schema names the two sources
    assert "'outbox' or 'internal_commands'" in unknown.json()["detail"][0]["msg"]
    assert missing.status_code == 404


async def test_a_token_whose_identity_holds_control_characters_is_401(container: OutboxContainer) -> None:
    """A CRLF in the tenant or a NUL in the user would be stored in every row the request writes
    and copied into broker headers and log lines: the token is refused instead."""
    async with live_server(container, with_worker=False) as base, httpx.AsyncClient(base_url=base) as client:
        answers = {
            label: await client.get(
                "/admin/outbox/pending",
                headers={
                    "Authorization": f"Bearer {token_for(container, roles=('outbox-admin',), **claims)}"
                },
            )
            for label, claims in {
                "crlf tenant": {"tenant": "acme\r\nx"},
                "nul user": {"user": "ali\x00ce"},
                "clean": {},
            }.items()
        }
    assert {label: answer.status_code for label, answer in answers.items()} == {
        "crlf tenant": 401,
        "nul user": 401,
        "clean": 200,
    }
    assert "must not contain control characters" in answers["crlf tenant"].json()["detail"]


async def test_readyz_masks_credentials_in_the_errors_it_shows(
    container: OutboxContainer, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def unreachable() -> None:
        raise ConnectionError("cannot reach postgresql+asyncpg://app:s3cret-pw@db.internal:5432/app")

    monkeypatch.setattr(container.database(), "ping", unreachable)
    async with live_server(container, with_worker=False) as base, httpx.AsyncClient(base_url=base) as client:
        ready = await client.get("/readyz")
    assert ready.status_code == 503
    assert ready.json()["checks"]["database"] == (
        "error: ConnectionError: cannot reach postgresql+asyncpg://app:***@db.internal:5432/app"
    )


async def test_a_role_the_stored_form_would_change_is_refused_and_a_valid_one_round_trips_exactly(
    container: OutboxContainer,
) -> None:
    """Roles are stored comma-joined: ``"outbox-admin "`` or ``"outbox,-admin"`` (403 at the
    admin API) would come back as ``outbox-admin`` in the context an internal command restores.
    Such a token is refused where it enters (401) and nothing is written; a valid role set comes
    back exactly as the API checked it."""
    kit = await install_kit(container)
    restored_roles: list[tuple[str, ...]] = []

    async def observe(_command: RecordEffect, _uow: object) -> None:
        restored_roles.append(current_context().roles)

    container.handlers().on_command(RecordEffect, observe)
    writes = APIRouter()

    @writes.post("/effects")
    async def write(
        _context: RequestContext = Depends(authenticated),
        units: UnitOfWorkFactory = Depends(units_of_work),
    ) -> dict[str, str]:
        async with units() as uow:
            uow.schedule(RecordEffect(label="role-check"))
            await uow.commit()
        return {"written": "yes"}

    secret = container.settings().auth.jwt_secret.get_secret_value()

    def token(roles: object) -> dict[str, str]:
        now = datetime.now(UTC)
        claims = {
            "sub": "alice",
            "tenant": "acme",
            "roles": roles,
            "iat": now,
            "exp": now + timedelta(minutes=5),
        }
        return {"Authorization": f"Bearer {jwt.encode(claims, secret, algorithm='HS256')}"}

    async with live_server(container, routers=[writes]) as base, httpx.AsyncClient(base_url=base) as client:
        for roles in (["clerk", "outbox-admin "], ["outbox,-admin"], [" outbox-admin"], ["clerk", ""]):
            refused = await client.post("/effects", headers=token(roles))
            assert refused.status_code == 401, (roles, refused.text)
            assert "'roles'" in refused.json()["detail"], refused.json()
        assert await fetch(container, sa.select(COMMAND_TABLE)) == []

        accepted = await client.post("/effects", headers=token(["clerk", "outbox-admin"]))
        assert accepted.status_code == 200, accepted.text
        await eventually(lambda: len(restored_roles) == 1)
    (row,) = await fetch(container, sa.select(COMMAND_TABLE))
    assert row.user_roles == "clerk,outbox-admin"
    assert restored_roles == [("clerk", "outbox-admin")]
    assert await kit.effects() == []


async def test_readyz_declares_which_source_names_it_reads(make_container: ContainerFactory) -> None:
    """The schema says what the probe reads (visible ASCII, as every source name is), so a
    schema-valid name is never refused as unstorable text; a NUL is refused with a clear 422."""
    container = make_container()
    (source,) = create_app(container).openapi()["paths"]["/readyz"]["get"]["parameters"]
    pattern = next(option["pattern"] for option in source["schema"]["anyOf"] if "pattern" in option)
    assert re.fullmatch(pattern, "billing")
    assert not re.fullmatch(pattern, "bill\x00ing")
    async with live_server(container, with_worker=False) as base, httpx.AsyncClient(base_url=base) as client:
        refused = await client.get("/readyz?source=%00")
    assert refused.status_code == 422
    assert refused.json()["detail"][0]["type"] == "unstorable_text"
