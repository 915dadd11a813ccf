"""The unit of work's contract, run on the kit's in-memory fake and on the SQL unit of work
(SQLite, and PostgreSQL in the ``postgres`` tier): a use case cannot tell them apart, so a unit
test on the fake proves what it would on the database.

Each check is written once against a :class:`Harness` (how to open a unit of work, what its
commits published and scheduled) over the test context's ``Counter`` aggregate and ``Counters``
port (``outbox_kit.testing.harness``): nothing is saved or published before ``commit``; a commit saves the
aggregate (a new unit of work loads the same state and version) and removes exactly the events
it captured; a stale version raises ``ConcurrencyError`` and saves nothing; an aggregate of
another tenant is not found; a failed savepoint block leaves nothing it collected; a
``before_commit`` write (an idempotency key's answer) sees the versions the commit saves.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import pytest
import sqlalchemy as sa
from outbox_kit.domain import ConcurrencyError, NotFoundError
from outbox_kit.persistence.tables import COMMAND_TABLE, INTEGRATION, OUTBOX_TABLE
from outbox_kit.public import TransactionalUnitOfWork
from outbox_kit.runtime.container import OutboxContainer
from outbox_kit.testing import InMemoryRepository, InMemoryStore, InMemoryUnitOfWork
from outbox_kit.testing.fixtures import acting_as, fetch, kit_container, make_settings
from outbox_kit.testing.harness import Counter, CounterChangedV1, Counters, RecordEffect, install_kit

pytestmark = pytest.mark.integration

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


class InMemoryCounters(InMemoryRepository[Counter]):
    aggregate_name = "counter"


@dataclass
class Harness:
    """One implementation under the contract."""

    open: Callable[[], TransactionalUnitOfWork]
    published: Callable[[], Awaitable[list[str]]]  # names of the committed integration events
    scheduled: Callable[[], Awaitable[list[str]]]  # names of the committed internal commands


def in_memory() -> Harness:
    store = InMemoryStore()

    async def published() -> list[str]:
        return [event.message_name for event in store.published]

    async def scheduled() -> list[str]:
        return [command.message_name for command, _ in store.scheduled]

    def open_one() -> InMemoryUnitOfWork:
        return InMemoryUnitOfWork(store, adapters={Counters: InMemoryCounters})

    return Harness(open_one, published, scheduled)


async def on_sql(container: OutboxContainer) -> Harness:
    await install_kit(container)
    outbox, commands = OUTBOX_TABLE.c, COMMAND_TABLE.c

    async def published() -> list[str]:
        rows = await fetch(container, sa.select(outbox.event_name).where(outbox.kind == INTEGRATION))
        return [row.event_name for row in rows]

    async def scheduled() -> list[str]:
        return [row.command_name for row in await fetch(container, sa.select(commands.command_name))]

    return Harness(container.units_of_work(), published, scheduled)


@pytest.fixture(params=["in-memory", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    """The fake, and the SQL unit of work on a fresh, migrated SQLite and PostgreSQL database."""
    if request.param == "in-memory":
        yield in_memory()
        return
    container = kit_container(make_settings(request.getfixturevalue(f"{request.param}_url")))
    try:
        yield await on_sql(container)
    finally:
        await container.database().dispose()


def changed(counter: Counter) -> CounterChangedV1:
    return CounterChangedV1(aggregate_id=counter.id, counter_id=counter.id, value=counter.value)


async def create(harness: Harness, counter_id: str = "c-1") -> Counter:
    async with harness.open() as uow:
        counter = Counter.create("acme", counter_id)
        uow.repository(Counters).add(counter)
        await uow.commit()
    return counter


async def test_nothing_is_saved_or_published_before_commit(harness: Harness) -> None:
    with acting_as("acme"):
        async with harness.open() as uow:
            counter = Counter.create("acme", "c-1")
            uow.repository(Counters).add(counter)
            uow.enqueue(changed(counter))
            uow.schedule(RecordEffect(label="later"))
        async with harness.open() as uow:
            with pytest.raises(NotFoundError):
                await uow.repository(Counters).get("c-1")
    assert await harness.published() == []
    assert await harness.scheduled() == []
    assert [type(event).__name__ for event in counter.pending_events] == ["Created"]


async def test_find_is_get_or_none_and_tracks_what_it_finds(harness: Harness) -> None:
    """The get-or-none path: nothing for an id not stored (or another tenant's), and an
    aggregate it finds is tracked, so the events raised on it are committed with it."""
    with acting_as("acme"):
        async with harness.open() as uow:
            assert await uow.repository(Counters).find("c-1") is None
            uow.repository(Counters).add(Counter.create("acme", "c-1"))
            await uow.commit()
        async with harness.open() as uow:
            found = await uow.repository(Counters).find("c-1")
            assert found is not None
            found.increment(by=2)
            uow.enqueue(changed(found))
            await uow.commit()
        async with harness.open() as uow:
            again = await uow.repository(Counters).get("c-1")
    with acting_as("globex"):
        async with harness.open() as uow:
            assert await uow.repository(Counters).find("c-1") is None
    assert (again.value, again.version) == (2, 2)
    assert await harness.published() == ["kit.counter-changed.v1"]


async def test_a_commit_saves_the_aggregate_and_removes_exactly_the_events_it_captured(
    harness: Harness,
) -> None:
    with acting_as("acme"):
        async with harness.open() as uow:
            counter = Counter.create("acme", "c-1")
            uow.repository(Counters).add(counter)
            uow.enqueue(changed(counter))
            uow.schedule(RecordEffect(label="later"))
            await uow.commit()
        assert (counter.pending_events, counter.version) == ((), 1)
        async with harness.open() as uow:
            loaded = await uow.repository(Counters).get("c-1")
            loaded.increment(by=3)
            await uow.commit()
            loaded.note("raised after the commit")  # stays pending for the next save
        assert (loaded.value, loaded.version) == (3, 2)
        assert [type(event).__name__ for event in loaded.pending_events] == ["Noted"]
        async with harness.open() as uow:
            again = await uow.repository(Counters).get("c-1")
    assert (again.value, again.version, again.tenant_id, again.pending_events) == (3, 2, "acme", ())
    assert await harness.published() == ["kit.counter-changed.v1"]
    assert await harness.scheduled() == ["kit.record-effect.v1"]


async def test_a_stale_version_raises_and_saves_nothing(harness: Harness) -> None:
    with acting_as("acme"):
        await create(harness)
        async with harness.open() as first, harness.open() as second:
            mine = await first.repository(Counters).get("c-1")
            theirs = await second.repository(Counters).get("c-1")
            mine.increment(by=1)
            await first.commit()
            theirs.increment(by=10)
            theirs_event = changed(theirs)
            second.enqueue(theirs_event)
            with pytest.raises(ConcurrencyError):
                await second.commit()
        async with harness.open() as uow:
            stored = await uow.repository(Counters).get("c-1")
    assert (stored.value, stored.version) == (1, 2)
    assert await harness.published() == []


async def test_an_aggregate_of_another_tenant_is_not_found(harness: Harness) -> None:
    with acting_as("acme"):
        await create(harness)
    with acting_as("globex"):
        async with harness.open() as uow:
            with pytest.raises(NotFoundError):
                await uow.repository(Counters).get("c-1")


async def refused_inside_a_savepoint(uow: TransactionalUnitOfWork, counter: Counter) -> None:
    async with uow.savepoint():
        counter.increment(by=100)
        uow.enqueue(changed(counter))
        uow.schedule(RecordEffect(label="inside"))
        raise RuntimeError("refused")


async def test_a_failed_savepoint_block_leaves_nothing_it_collected(harness: Harness) -> None:
    with acting_as("acme"):
        await create(harness)
        async with harness.open() as uow:
            counter = await uow.repository(Counters).get("c-1")
            counter.increment(by=1)
            with pytest.raises(RuntimeError, match="refused"):
                await refused_inside_a_savepoint(uow, counter)
            assert counter.value == 1
            await uow.commit()
        async with harness.open() as uow:
            stored = await uow.repository(Counters).get("c-1")
    assert (stored.value, stored.version) == (1, 2)
    assert await harness.published() == []
    assert await harness.scheduled() == []


async def test_run_commits_what_the_operation_collected(harness: Harness) -> None:
    async def operation(uow: TransactionalUnitOfWork) -> str:
        counter = Counter.create("acme", "c-9")
        uow.repository(Counters).add(counter)
        uow.enqueue(changed(counter))
        return counter.id

    with acting_as("acme"):
        assert await harness.open().run(operation) == "c-9"
        async with harness.open() as uow:
            stored = await uow.repository(Counters).get("c-9")
    assert stored.version == 1
    assert await harness.published() == ["kit.counter-changed.v1"]


async def test_a_before_commit_write_sees_the_saved_versions(harness: Harness) -> None:
    seen: list[int] = []
    with acting_as("acme"):
        await create(harness)
        async with harness.open() as uow:
            counter = await uow.repository(Counters).get("c-1")
            counter.increment(by=1)

            async def record_the_answer() -> None:  # what an Idempotency-Key's answer does
                seen.append(counter.version)

            uow.before_commit(record_the_answer)
            await uow.commit()
    assert seen == [2]
    assert counter.version == 2


def test_the_fake_reads_its_clock_and_refuses_a_port_it_has_no_adapter_for() -> None:
    uow = InMemoryUnitOfWork(now=NOW)
    assert uow.now == NOW
    with pytest.raises(LookupError, match="no in-memory adapter for Counters"):
        uow.repository(Counters)
    with pytest.raises(RuntimeError, match="no database session"):
        _ = uow.session
