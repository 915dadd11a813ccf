"""The framework's idempotency keys (``outbox_kit.persistence.idempotency``) on SQLite and PostgreSQL,
with the test kit's aggregate (the example's ``POST /orders`` is covered over HTTP in
test_example_idempotency_keys.py): the key row commits with what the command created or not at
all, concurrent runs with one key create one thing, the answer shows the saved version, and the
retention sweep purges expired keys."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from outbox_kit.application.unit_of_work import (
    UnitOfWork,
)
from outbox_kit.persistence.idempotency import (
    Answer,
    IdempotencyKey,
    IdempotencyKeyReusedError,
    run_once,
)
from outbox_kit.persistence.tables import (
    IDEMPOTENCY_KEYS_TABLE,
)
from outbox_kit.runtime.container import OutboxContainer
from outbox_kit.testing.fixtures import ContainerFactory, acting_as, fetch
from outbox_kit.testing.harness import COUNTERS, Counter, Counters, install_kit

pytestmark = pytest.mark.integration
KEY = IdempotencyKey("k-1", "POST /counters")
CONCURRENT = 8


async def create(uow: UnitOfWork) -> Counter:
    counter = Counter.create("acme")
    uow.repository(Counters).add(counter)
    return counter


async def create_then_die(uow: UnitOfWork) -> Counter:
    await create(uow)
    msg = "the process died here"
    raise RuntimeError(msg)


def once(
    container: OutboxContainer,
    operation: Callable[[UnitOfWork], Awaitable[Counter]],
    request: object = None,
    key: IdempotencyKey | None = KEY,
) -> Awaitable[Answer]:
    return run_once(
        container.units_of_work(),
        operation,
        present=lambda counter: {"id": counter.id, "version": counter.version},
        key=key,
        request=request if request is not None else {"start": 0},
        status_code=201,
    )


async def counters(container: OutboxContainer) -> list[Any]:
    return await fetch(container, sa.select(COUNTERS.c.id, COUNTERS.c.tenant_id))


async def keys(container: OutboxContainer) -> list[Any]:
    return await fetch(container, sa.select(IDEMPOTENCY_KEYS_TABLE))


async def test_a_failed_command_records_no_key_so_its_retry_runs(container: OutboxContainer) -> None:
    """The key row is written in the command's transaction: when the command fails after the
    key was taken, both roll back (no key without its effect, no effect without its key), and
    the retry with the same key runs the command; after that the key answers without running."""
    await install_kit(container)
    with acting_as():
        with pytest.raises(RuntimeError, match="the process died here"):
            await once(container, create_then_die)
        assert (await keys(container), await counters(container)) == ([], [])
        created = await once(container, create)
        again = await once(container, create_then_die)  # answered from the key: not run
    (counter,) = await counters(container)
    assert json.loads(created.body) == {"id": counter.id, "version": 1}  # the saved version
    assert (again.body, again.replayed, created.replayed) == (created.body, True, False)
    (row,) = await keys(container)
    assert (row.tenant_id, row.key, row.status_code, row.response_body) == ("acme", "k-1", 201, created.body)


async def test_another_request_under_a_key_is_refused_and_tenants_do_not_share_keys(
    container: OutboxContainer,
) -> None:
    await install_kit(container)
    with acting_as(tenant="acme"):
        first = await once(container, create)
        with pytest.raises(IdempotencyKeyReusedError, match="k-1"):
            await once(container, create, request={"start": 5})
        with pytest.raises(IdempotencyKeyReusedError):  # the same body to another operation
            await once(container, create, key=IdempotencyKey("k-1", "POST /other"))
    with acting_as(tenant="globex"):
        other = await once(container, create)
    assert not other.replayed
    assert json.loads(other.body)["id"] != json.loads(first.body)["id"]
    assert sorted(k.tenant_id for k in await keys(container)) == ["acme", "globex"]
    assert len(await counters(container)) == 2


async def test_concurrent_runs_with_one_key_create_one_thing(container: OutboxContainer) -> None:
    await install_kit(container)
    with acting_as():
        answers = await asyncio.gather(*(once(container, create) for _ in range(CONCURRENT)))
    assert len({a.body for a in answers}) == 1
    assert sum(not a.replayed for a in answers) == 1
    assert [c.id for c in await counters(container)] == [json.loads(answers[0].body)["id"]]


async def test_without_a_key_every_run_creates(container: OutboxContainer) -> None:
    await install_kit(container)
    with acting_as():
        answers = [await once(container, create, key=None) for _ in range(2)]
    assert [json.loads(a.body)["version"] for a in answers] == [1, 1]
    assert (len(await counters(container)), await keys(container)) == (2, [])


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
    assert [k.key for k in await keys(container)] == ["young"]
