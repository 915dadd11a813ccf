"""The leases of in-process dispatch: rows a commit inserted already leased to this process.

A lease only keeps other replicas away while it lasts. These tests prove that the committing
process renews each row's lease just before it delivers it and skips a row another replica took
meanwhile, that a row it gives back wakes every replica (not only itself), and that rows a
handler cascaded into are given back when the process shuts down mid-dispatch.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from dependency_injector import providers
from outbox_kit.persistence.tables import (
    OUTBOX_TABLE,
)
from outbox_kit.persistence.unit_of_work import SqlUnitOfWork
from outbox_kit.processor.claim import (
    Claimer,
)
from outbox_kit.runtime.container import OutboxContainer
from outbox_kit.runtime.settings import ServiceSettings
from outbox_kit.testing.fixtures import (
    ContainerFactory,
    acting_as,
    eventually,
    fetch,
    kit_container,
    make_settings,
)
from outbox_kit.testing.harness import (
    Counter,
    Counters,
    Created,
    FakeClock,
    Kit,
    Noted,
    insert_rows,
    install_kit,
    outbox_source,
    row,
)

pytestmark = pytest.mark.integration


async def outbox(container: OutboxContainer) -> list[Any]:
    return await fetch(container, sa.select(OUTBOX_TABLE).order_by(OUTBOX_TABLE.c.seq))


async def test_a_row_another_replica_took_during_an_earlier_handler_is_not_delivered(
    make_container: ContainerFactory,
) -> None:
    """Two rows of one commit, a 15 s lease, and a first handler that runs past it (on the fake
    clock: its 10 s time limit is real time): a replica
    claims both rows meanwhile. The committing process must not run the second row's handler
    (its effects outside the database would happen twice): its renewal finds the row gone."""
    clock = FakeClock()
    container = make_container(outbox={"lease_seconds": 15, "delivery_timeout_seconds": 10})
    container.clock.override(providers.Object(clock))
    kit = await install_kit(container)
    replica = uuid.uuid4()
    ran: list[str] = []

    async def slow_first_handler(event: Noted, uow: SqlUnitOfWork) -> None:
        ran.append(event.text)
        if event.text != "first":
            return
        clock.advance(16)  # the handler outlives the lease and the processing delay

        async def replica_claims() -> None:
            claimer = Claimer(OUTBOX_TABLE, "event_name", batch=10, window=80)
            async with container.database().bookkeeping() as connection:
                await claimer.claim(
                    connection,
                    now=clock.now,
                    lease_until=clock.now + timedelta(seconds=60),
                    token=replica,
                    locked_by="replica",
                )

        # Another process's claim: a context of its own, not this handler's.
        await asyncio.create_task(replica_claims(), context=contextvars.Context())

    kit.on(Noted, slow_first_handler)
    with acting_as():
        async with container.units_of_work()() as uow:
            counter = Counter.create("acme")
            counter.note("first")
            counter.note("second")
            uow.repository(Counters).add(counter)
            await uow.commit()

    assert ran == ["first"], "the committer delivered a row the replica had claimed"
    noted = [r for r in await outbox(container) if r.event_name == "kit.noted.v1"]
    assert [(r.lock_token, r.processed_on) for r in noted] == [(replica, None), (replica, None)]


async def test_a_row_is_renewed_just_before_its_in_process_delivery(make_container: ContainerFactory) -> None:
    """Each row's lease is pushed to now + lease right before its handlers run, so a row that
    waited behind a slow earlier row still has a whole lease for its own delivery."""
    clock = FakeClock()
    container = make_container(outbox={"lease_seconds": 60, "delivery_timeout_seconds": 45})
    container.clock.override(providers.Object(clock))
    kit = await install_kit(container)
    leases: dict[str, Any] = {}

    async def note_handler(event: Noted, uow: SqlUnitOfWork) -> None:
        (mine,) = [r for r in await outbox(container) if r.payload.get("text") == event.text]
        leases[event.text] = mine.locked_until
        clock.advance(40)  # each handler takes 40 s of the 60 s lease

    kit.on(Noted, note_handler)
    start = clock.now
    with acting_as():
        async with container.units_of_work()() as uow:
            counter = Counter.create("acme")
            counter.note("first")
            counter.note("second")
            uow.repository(Counters).add(counter)
            await uow.commit()
    assert leases["first"] == start + timedelta(seconds=60)
    assert leases["second"] == start + timedelta(seconds=100)  # renewed at +40 s
    noted = [r for r in await outbox(container) if r.event_name == "kit.noted.v1"]
    assert [r.processed_on is not None for r in noted] == [True, True]


@pytest.mark.postgres
async def test_a_row_released_in_process_wakes_a_worker_in_another_process(postgres_url: str) -> None:
    """API and worker in separate processes (here: separate containers, each with its own
    engine and signals). The API's in-process dispatch fails and releases the row; the release
    sends NOTIFY, so the worker delivers it after the processing delay, not after its 30 s
    fallback poll."""
    one_service = {"namespace": f"t{uuid.uuid4().hex[:10]}"}  # one NOTIFY channel
    async with containers(
        make_settings(
            postgres_url,
            application=one_service,
            outbox={"polling_interval_seconds": 30, "processing_delay_seconds": 0.5},
        ),
        make_settings(postgres_url, application=one_service, outbox={"processing_delay_seconds": 0.5}),
    ) as (worker_side, api_side):
        worker_kit = await install_kit(worker_side)
        worker_kit.on(Created, worker_kit.recording("worker"))
        api_kit = await install_kit(api_side, create_tables=False)

        async def fails_in_the_api(event: Created, uow: SqlUnitOfWork) -> None:
            msg = "the API's attempt fails"
            raise RuntimeError(msg)

        api_kit.on(Created, fails_in_the_api)
        async with running_worker(worker_side):
            with acting_as():
                async with api_side.units_of_work()() as uow:
                    uow.repository(Counters).add(Counter.create("acme"))
                    await uow.commit()
            (released,) = await outbox(worker_side)
            assert released.lock_token is None  # given back by the API process
            await eventually(lambda: bool(worker_kit.seen), timeout=10)


@contextlib.asynccontextmanager
async def containers(*settings: ServiceSettings) -> AsyncIterator[list[OutboxContainer]]:
    built = [kit_container(each) for each in settings]
    try:
        yield built
    finally:
        for container in built:
            await container.database().dispose()


@contextlib.asynccontextmanager
async def running_worker(container: OutboxContainer) -> AsyncIterator[None]:
    worker = container.worker()
    await worker.start()
    (listener,) = container.listeners()
    try:
        await asyncio.wait_for(listener.connected.wait(), 10)
        await asyncio.sleep(0.3)  # the first cycles have run: from here on the loop sleeps
        yield
    finally:
        await worker.stop()


async def test_cascaded_rows_are_released_when_the_processor_shuts_down(container: OutboxContainer) -> None:
    """The processor delivers a row whose handler raises more events; their rows commit leased
    to this process under a token of their own, and the shutdown comes while one of their
    handlers runs. Those rows must be given back (uncharged), not left leased for the whole
    lease."""
    kit: Kit = await install_kit(container)
    cascade_running = asyncio.Event()

    async def cascades(event: Created, uow: SqlUnitOfWork) -> None:
        if event.aggregate_id == "parent":
            child = Counter.create("acme", "child")
            child.note("blocks")
            uow.repository(Counters).add(child)

    async def blocks(event: Noted, uow: SqlUnitOfWork) -> None:
        cascade_running.set()
        await asyncio.Event().wait()  # interrupted by the shutdown

    kit.on(Created, cascades)
    kit.on(Noted, blocks)
    parent = Created(aggregate_id="parent", tenant_id="acme")
    now = container.clock()()
    await insert_rows(
        container,
        [row(parent.message_name, now, kind="domain", payload=container.registry().dump(parent))],
    )
    source = outbox_source(container, container.outbox_deliverer())
    with acting_as():
        cycle = asyncio.create_task(source.run_cycle())
        await asyncio.wait_for(cascade_running.wait(), 10)
    cycle.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await cycle
    rows = {
        r.payload.get("aggregate_id"): r for r in await outbox(container) if r.event_name != "kit.created.v1"
    }
    (noted,) = rows.values()
    assert noted.processed_on is None
    assert (noted.lock_token, noted.locked_until, noted.retry_count) == (None, None, 0)
