"""A cancellation right after the business COMMIT (a stop cancelling the request, a time limit):
the domain-event rows the commit inserted leased to this process are given back by the commit's
token at once, not left leased for the whole lease, and the processor delivers each of them
once after the processing delay. Both databases."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import sqlalchemy as sa
from outbox_kit.persistence.tables import OUTBOX_TABLE
from outbox_kit.persistence.unit_of_work import SqlUnitOfWork
from outbox_kit.runtime.container import OutboxContainer
from outbox_kit.testing.fixtures import ContainerFactory, acting_as, eventually, fetch
from outbox_kit.testing.harness import Counter, Counters, Noted, install_kit, record_effect

pytestmark = pytest.mark.integration
# The lease far longer than the test: a row left leased would never be delivered in time.
SETTINGS = {"lease_seconds": 300, "processing_delay_seconds": 0.5, "shutdown_timeout_seconds": 4}


class Blocks:
    """A local handler that blocks on its first run (until cancelled) and records an effect after."""

    def __init__(self, *, first_blocks: bool) -> None:
        self.runs: list[str] = []
        self.first_blocks = first_blocks
        self.started = asyncio.Event()

    async def __call__(self, event: Noted, uow: SqlUnitOfWork) -> None:
        self.runs.append(event.text)
        if self.first_blocks and len(self.runs) == 1:
            self.started.set()
            await asyncio.Event().wait()  # never set: only a cancellation ends it
        await record_effect(uow, f"noted:{event.text}")


async def note(container: OutboxContainer, text: str, *, hang_after_commit: asyncio.Event | None) -> None:
    """Commit a note; with ``hang_after_commit``, the session's COMMIT lands and then its call
    does not return (a cancellation arriving right after the database committed)."""
    with acting_as():
        async with container.units_of_work()() as uow:
            counter = Counter.create("acme")
            counter.note(text)
            uow.repository(Counters).add(counter)
            if hang_after_commit is not None:
                session = uow.session
                commit = session.commit

                async def commit_then_hang() -> None:
                    await commit()
                    hang_after_commit.set()
                    await asyncio.Event().wait()

                session.commit = commit_then_hang  # type: ignore[method-assign]
            await uow.commit()


async def noted(container: OutboxContainer) -> Any:
    statement = sa.select(OUTBOX_TABLE).where(OUTBOX_TABLE.c.event_name == "kit.noted.v1")
    (row,) = await fetch(container, statement)
    return row


async def cancel_once(task: asyncio.Task[None], reached: asyncio.Event) -> None:
    await asyncio.wait_for(reached.wait(), 20)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 20)


async def delivered_once(container: OutboxContainer, handler: Blocks) -> None:
    """The worker's processor delivers the given-back row once (long before the lease ends)."""
    await container.worker().start()
    try:
        deadline = time.monotonic() + 30
        while (await noted(container)).processed_on is None:
            assert time.monotonic() < deadline, "the row was not delivered: still leased?"
            await asyncio.sleep(0.1)
    finally:
        await asyncio.wait_for(container.worker().stop(), 30)
    from outbox_kit.testing.harness import effects

    async with container.database().session() as session:
        assert await effects(session) == ["noted:x"]
    assert handler.runs.count("x") == (2 if handler.first_blocks else 1)


async def test_a_cancellation_during_the_commit_gives_the_leased_rows_back(
    make_container: ContainerFactory,
) -> None:
    """The COMMIT landed but its caller was cancelled before it returned: the rows it leased to
    this process are given back by the commit's token (uncharged, no lease left)."""
    container = make_container(outbox=SETTINGS)
    await install_kit(container)
    handler = Blocks(first_blocks=False)
    container.handlers().on_domain_event(Noted, handler)
    committed = asyncio.Event()
    await cancel_once(asyncio.create_task(note(container, "x", hang_after_commit=committed)), committed)
    row = await noted(container)
    assert (row.lock_token, row.locked_until, row.locked_by, row.retry_count) == (None, None, None, 0)
    assert row.processed_on is None
    assert handler.runs == []
    await delivered_once(container, handler)


async def test_a_cancellation_during_the_after_commit_dispatch_gives_the_rows_back(
    make_container: ContainerFactory,
) -> None:
    """The commit returned and its in-process dispatch is running when the cancellation comes."""
    container = make_container(outbox=SETTINGS)
    await install_kit(container)
    handler = Blocks(first_blocks=True)
    container.handlers().on_domain_event(Noted, handler)
    await cancel_once(asyncio.create_task(note(container, "x", hang_after_commit=None)), handler.started)
    row = await noted(container)
    assert (row.lock_token, row.locked_until, row.locked_by, row.retry_count) == (None, None, None, 0)
    await eventually(lambda: handler.runs == ["x"])
    await delivered_once(container, handler)
