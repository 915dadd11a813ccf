"""Who sees which rows: ``outbox-admin`` is scoped to its token's tenant, the operator role (and
the CLI, an operator tool) sees every tenant, rows without a tenant included."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import httpx
import pytest
from outbox_kit.runtime.container import OutboxContainer
from outbox_kit.testing.fixtures import live_server, token_for
from outbox_kit.testing.harness import insert_rows, row, state
from test_topology_and_cli import cli

pytestmark = pytest.mark.integration


async def seed(container: OutboxContainer) -> dict[str, uuid.UUID]:
    """A dead letter of acme, one of globex, one without a tenant, and a pending globex row."""
    now = container.clock()()
    dead = {"dead_lettered_on": now, "dead_letter_reason": "retries_exhausted", "retry_count": 5}
    names = ["acme", "globex", "no tenant", "globex pending"]
    ids = await insert_rows(
        container,
        [
            row("kit.a.v1", now, tenant_id="acme", last_error="acme broke", **dead),
            row("kit.a.v1", now, tenant_id="globex", last_error="globex broke", **dead),
            row("kit.a.v1", now, last_error="system broke", **dead),
            row("kit.a.v1", now, tenant_id="globex"),
        ],
    )
    return dict(zip(names, ids, strict=True))


def as_caller(container: OutboxContainer, tenant: str, role: str) -> dict[str, str]:
    return {
        "Authorization": f"Bearer {token_for(container, tenant=tenant, user=f'{tenant}-ops', roles=(role,))}"
    }


async def look(client: httpx.AsyncClient, ids: dict[str, uuid.UUID]) -> dict[str, Any]:
    """Everything a caller can learn: the list, the counts, and explain of each row."""
    listed = (await client.get("/admin/outbox/dead-letters", params={"source": "outbox"})).json()
    (pending,) = (await client.get("/admin/outbox/pending", params={"source": "outbox"})).json()
    explained = {
        name: (await client.get(f"/admin/outbox/outbox/{i}/explain")).status_code for name, i in ids.items()
    }
    return {"listed": sorted(d["last_error"] for d in listed), "pending": pending, "explain": explained}


async def test_an_admin_sees_and_replays_only_its_own_tenant(container: OutboxContainer) -> None:
    ids = await seed(container)
    async with (
        live_server(container, with_worker=False) as base,
        httpx.AsyncClient(base_url=base, headers=as_caller(container, "acme", "outbox-admin")) as client,
    ):
        seen = await look(client, ids)
        foreign = await client.post("/admin/outbox/dead-letters/replay", json={"ids": [str(ids["globex"])]})
        unknown = await client.post("/admin/outbox/dead-letters/replay", json={"ids": [str(uuid.uuid4())]})
        mixed = await client.post(
            "/admin/outbox/dead-letters/replay", json={"ids": [str(ids["acme"]), str(ids["no tenant"])]}
        )
        own = await client.post("/admin/outbox/dead-letters/replay", json={"ids": [str(ids["acme"])]})
    assert seen["listed"] == ["acme broke"]
    assert (seen["pending"]["pending"], seen["pending"]["dead_lettered"]) == (0, 1)
    assert seen["explain"] == {"acme": 200, "globex": 404, "no tenant": 404, "globex pending": 404}
    # Another tenant's row answers exactly like a row that does not exist: nothing is revealed.
    assert (foreign.status_code, unknown.status_code, mixed.status_code) == (404, 404, 404)
    assert foreign.json()["detail"] == f"no outbox row has id {ids['globex']}"
    assert own.status_code == 200
    assert (await state(container, ids["globex"])).dead_lettered_on is not None
    assert (await state(container, ids["no tenant"])).dead_lettered_on is not None
    assert (await state(container, ids["acme"])).dead_lettered_on is None


async def test_the_operator_role_sees_and_replays_every_tenant(container: OutboxContainer) -> None:
    ids = await seed(container)
    async with (
        live_server(container, with_worker=False) as base,
        httpx.AsyncClient(base_url=base, headers=as_caller(container, "ops", "outbox-operator")) as client,
    ):
        seen = await look(client, ids)
        replayed = await client.post(
            "/admin/outbox/dead-letters/replay", json={"ids": [str(ids["globex"]), str(ids["no tenant"])]}
        )
    assert seen["listed"] == ["acme broke", "globex broke", "system broke"]
    assert (seen["pending"]["pending"], seen["pending"]["dead_lettered"]) == (1, 3)
    assert set(seen["explain"].values()) == {200}
    assert replayed.status_code == 200
    assert sorted(replayed.json()["replayed"]) == sorted([str(ids["globex"]), str(ids["no tenant"])])


async def test_the_operator_role_is_a_setting(make_container: Any) -> None:
    container = make_container(auth={"operator_role": "sre"})
    ids = await seed(container)
    async with live_server(container, with_worker=False) as base, httpx.AsyncClient(base_url=base) as client:
        sre = await client.get(
            "/admin/outbox/dead-letters",
            headers=as_caller(container, "ops", "sre"),
            params={"source": "outbox"},
        )
        default_name = await client.get(
            "/admin/outbox/dead-letters", headers=as_caller(container, "ops", "outbox-operator")
        )
    assert len(sre.json()) == 3, sre.text
    assert default_name.status_code == 403
    assert ids


async def test_the_cli_is_an_operator_tool_with_an_optional_tenant_filter(container: OutboxContainer) -> None:
    ids = await seed(container)
    url = container.settings().database.url

    async def outbox(*args: str) -> Any:
        result = await asyncio.to_thread(cli, url, *args)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    everyone = await outbox("dead-letters")
    acme = await outbox("dead-letters", "--tenant", "acme")
    (globex_counts,) = [c for c in await outbox("pending", "--tenant", "globex") if c["source"] == "outbox"]
    foreign = await asyncio.to_thread(cli, url, "explain", "--tenant", "acme", str(ids["globex"]))
    refused = await asyncio.to_thread(cli, url, "replay", "--tenant", "acme", str(ids["globex"]))
    assert sorted(d["last_error"] for d in everyone) == ["acme broke", "globex broke", "system broke"]
    assert [d["last_error"] for d in acme] == ["acme broke"]
    assert (globex_counts["pending"], globex_counts["dead_lettered"]) == (1, 1)
    assert (foreign.returncode, refused.returncode) == (2, 2)
    assert "no outbox row has id" in refused.stderr
    assert (await state(container, ids["globex"])).dead_lettered_on is not None


async def test_explain_names_a_blocking_row_of_another_tenant_only_to_operators(
    container: OutboxContainer,
) -> None:
    """Ordering keys may cross tenants: the admin learns that its row waits, not which row."""
    now = container.clock()()
    blocker, waiting = await insert_rows(
        container,
        [
            row("kit.a.v1", now, key="shared", tenant_id="globex"),
            row("kit.a.v1", now, key="shared", tenant_id="acme"),
        ],
    )
    async with live_server(container, with_worker=False) as base, httpx.AsyncClient(base_url=base) as client:
        admin, operator = [
            (
                await client.get(
                    f"/admin/outbox/outbox/{waiting}/explain", headers=as_caller(container, tenant, role)
                )
            ).json()
            for tenant, role in (("acme", "outbox-admin"), ("ops", "outbox-operator"))
        ]
    assert (admin["state"], operator["state"]) == ("blocked", "blocked")
    assert str(blocker) not in admin["detail"]
    assert "an earlier row of another tenant" in admin["detail"]
    assert str(blocker) in operator["detail"]
