"""The claim against what runs beside it: a replay of a dead letter, and a stop of the process.

* A claim sees a snapshot. A replay committed while a claim was running used to let a second
  claim take the replayed head of a key while the first one took the key's next row: two rows of
  one key in flight. Replays and claims of a table are serialized on PostgreSQL (SQLite
  serializes writers); the interleaving is forced here with a trigger that holds the first claim
  inside its statement, after its snapshot, until the test lets it go.
* The claim commits on its own. A stop that arrives after the server committed it and before the
  rows reached the cycle used to leave the whole batch leased for a lease under a token nobody
  held; the cycle now gives those rows back, uncharged. So it does when the stop cancels a claim
  whose COMMIT lands only afterwards: the release waits for the cancelled claim to end.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import datetime
from typing import Any

import pytest
import sqlalchemy as sa
from outbox_kit.operations.rows import (
    EVERY_TENANT,
    return_to_pending,
)
from outbox_kit.persistence.tables import (
    COMMAND_TABLE,
    OUTBOX,
    OUTBOX_TABLE,
    DeadLetterReplay,
)
from outbox_kit.processor.claim import (
    ClaimedRow,
)
from outbox_kit.runtime.container import OutboxContainer
from outbox_kit.testing.fixtures import (
    SERVICE_URLS,
    create_postgres_database,
    drop_postgres_database,
    kit_container,
    make_settings,
    run_async,
)
from outbox_kit.testing.harness import (
    FakeClock,
    ScriptedDeliverer,
    insert_rows,
    outbox_source,
    polled_source,
    row,
    state,
)
from outbox_kit.transports.bus import (
    Delivered,
)
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, create_async_engine

pytestmark = pytest.mark.integration

HOLD = 0x5E9A  # the session advisory lock the trigger waits for

# Holds a claim by the processor "replica-a" inside its statement: the statement has taken its
# snapshot and locked its rows, and waits here before it can commit.
HOLD_CLAIM = f"""CREATE OR REPLACE FUNCTION test_hold_claim() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN PERFORM pg_advisory_xact_lock({HOLD}); RETURN NEW; END $$"""
TABLES = (OUTBOX_TABLE, COMMAND_TABLE)


def hold_trigger(table: sa.Table) -> str:
    return f"""CREATE TRIGGER test_hold_claim BEFORE UPDATE ON {table.name} FOR EACH ROW
    WHEN (NEW.locked_by = 'replica-a' AND NEW.lock_token IS DISTINCT FROM OLD.lock_token)
    EXECUTE FUNCTION test_hold_claim()"""


@pytest.fixture(scope="session")
def repeatable_read_url(migrate_database: Callable[[str], None]) -> Iterator[str]:
    """A PostgreSQL database whose default isolation is REPEATABLE READ (a server or database
    configured so): the service must still run READ COMMITTED on it, having set it itself."""
    url = create_postgres_database()
    migrate_database(url)
    run_async(set_default_isolation(url))
    yield url
    drop_postgres_database(url)


async def set_default_isolation(url: str) -> None:
    engine = create_async_engine(SERVICE_URLS["postgres"], isolation_level="AUTOCOMMIT")
    async with engine.connect() as connection:
        name = url.rsplit("/", 1)[1]
        await connection.exec_driver_sql(
            f"ALTER DATABASE \"{name}\" SET default_transaction_isolation = 'repeatable read'"
        )
    await engine.dispose()


async def empty_tables(url: str) -> None:
    engine = create_async_engine(url)
    async with engine.begin() as connection:
        for table in (OUTBOX_TABLE, COMMAND_TABLE, DeadLetterReplay.__table__):  # type: ignore[attr-defined]
            await connection.execute(table.delete())
    await engine.dispose()


@pytest.fixture
def race_url(request: pytest.FixtureRequest, postgres_url: str) -> str:
    """The session database, or (``indirect`` parameter ``repeatable-read``) the one whose
    default isolation is REPEATABLE READ."""
    if getattr(request, "param", "default") == "repeatable-read":
        url: str = request.getfixturevalue("repeatable_read_url")
        run_async(empty_tables(url))
        return url
    return postgres_url


@pytest.fixture
async def pg_container(race_url: str) -> AsyncIterator[OutboxContainer]:
    container = kit_container(make_settings(race_url))
    yield container
    await container.database().dispose()


@pytest.fixture
async def control(race_url: str) -> AsyncIterator[AsyncConnection]:
    """A connection of the test's own, outside the service's pools: installs the trigger and
    holds the lock it waits for."""
    engine = create_async_engine(race_url)
    async with engine.connect() as plain:
        connection = await plain.execution_options(isolation_level="AUTOCOMMIT")
        for statement in (HOLD_CLAIM, *(hold_trigger(table) for table in TABLES)):
            await connection.exec_driver_sql(statement)
        try:
            yield connection
        finally:
            await connection.exec_driver_sql("SELECT pg_advisory_unlock_all()")
            for table in TABLES:
                await connection.exec_driver_sql(f"DROP TRIGGER IF EXISTS test_hold_claim ON {table.name}")
    await engine.dispose()


async def lock_waiters(connection: AsyncConnection) -> int:
    """Backends of this database waiting for a heavyweight lock (an advisory one included)."""
    statement = sa.text(
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE datname = current_database() AND wait_event_type = 'Lock'"
    )
    return int((await connection.execute(statement)).scalar_one())


async def settled(task: asyncio.Future[Any], connection: AsyncConnection, waiters: int) -> None:
    """Wait until ``task`` has finished or ``waiters`` backends wait for a lock (it is blocked)."""
    deadline = asyncio.get_running_loop().time() + 20
    while not task.done() and await lock_waiters(connection) < waiters:
        assert asyncio.get_running_loop().time() < deadline, "neither finished nor blocked"
        await asyncio.sleep(0.02)


async def leased_rows_of_key(
    container: OutboxContainer, table: sa.Table, key: str, now: datetime
) -> list[uuid.UUID]:
    t = table.c
    statement = sa.select(t.id).where(
        t.ordering_key == key,
        t.processed_on.is_(None),
        t.dead_lettered_on.is_(None),
        t.lock_token.is_not(None),
        t.locked_until >= now,
    )
    async with container.database().session() as session:
        return [r[0] for r in (await session.exec(statement)).all()]  # type: ignore[call-overload]


async def a_dead_head_and_its_successor(
    container: OutboxContainer, table: sa.Table, now: datetime
) -> list[uuid.UUID]:
    """Two rows of key k; the first one dead-lettered, so the second is the key's head."""
    rows = [row("kit.k.v1", now, key="k") for _ in range(2)]
    if table is COMMAND_TABLE:  # a command row has a command name and no kind
        for values in rows:
            values["command_name"] = values.pop("event_name")
            del values["kind"]
    dead, later = await insert_rows(container, rows, table)
    async with container.database().session() as session:
        await session.exec(  # type: ignore[call-overload]
            table.update()
            .where(table.c.id == dead)
            .values(dead_lettered_on=now, dead_letter_reason="retries_exhausted", retry_count=3)
        )
        await session.commit()
    return [dead, later]


@pytest.mark.postgres
@pytest.mark.parametrize("race_url", ["default", "repeatable-read"], indirect=True)
@pytest.mark.parametrize("table", TABLES, ids=lambda table: table.name)
async def test_a_replay_committed_during_a_claim_never_puts_two_rows_of_one_key_in_flight(
    pg_container: OutboxContainer, control: AsyncConnection, table: sa.Table
) -> None:
    """Replica A's claim takes its snapshot while seq 1 of key k is a dead letter, so seq 2 is
    the key's head. Before A commits, an operator replays seq 1, and replica B claims: in B's
    snapshot seq 1 is the head and A's lease on seq 2 is not visible yet. B must not take seq 1
    while A takes seq 2.

    Also on a database whose default isolation is REPEATABLE READ: the service sets READ
    COMMITTED itself, so the claims and the replay neither fail with a serialization error nor
    miss each other's commits."""
    clock = FakeClock()
    container = pg_container
    dead, later = await a_dead_head_and_its_successor(container, table, clock.now)
    name = "outbox" if table is OUTBOX_TABLE else "internal_commands"
    replica_a = polled_source(container, name, ScriptedDeliverer(), clock, instance_id="replica-a")  # held
    replica_b = polled_source(container, name, ScriptedDeliverer(), clock, instance_id="replica-b")

    await control.execute(sa.text(f"SELECT pg_advisory_lock({HOLD})"))
    claim_a = asyncio.ensure_future(replica_a.claim(uuid.uuid4()))
    await settled(claim_a, control, 1)
    assert not claim_a.done(), "the trigger did not hold replica A's claim"
    replay = asyncio.ensure_future(container.admin().replay(name, [str(dead)], actor="operator"))
    await settled(replay, control, 2)
    claim_b = asyncio.ensure_future(replica_b.claim(uuid.uuid4()))
    await settled(claim_b, control, 3)
    await control.execute(sa.text(f"SELECT pg_advisory_unlock({HOLD})"))
    claimed_a, _, claimed_b = await asyncio.wait_for(asyncio.gather(claim_a, replay, claim_b), 20)

    assert [r.id for r in claimed_a] == [later]
    assert [r.id for r in claimed_b] == [], "replica B took the replayed head while A held seq 2"
    assert await leased_rows_of_key(container, table, "k", clock.now) == [later]
    assert (await state(container, dead, table)).dead_lettered_on is None  # the replay went through


@pytest.mark.postgres
@pytest.mark.slow
async def test_replays_racing_three_claimers_never_put_two_rows_of_a_key_in_flight(
    pg_container: OutboxContainer,
) -> None:
    """No forced interleaving: three processors drain four keys (each on its own connections)
    while an operator keeps replaying what they dead-letter. No key may ever have two rows in a
    delivery at once."""
    container = pg_container
    now = container.clock()()
    keys = [f"k{i}" for i in range(4)]
    await insert_rows(container, [row("kit.k.v1", now, key=keys[i % len(keys)]) for i in range(400)])
    flying: dict[str, uuid.UUID] = {}
    overlaps: list[tuple[str, uuid.UUID, uuid.UUID]] = []
    rng = random.Random(22)
    stop = asyncio.Event()
    counts = {"deliveries": 0, "replays": 0}

    async def deliver(claimed: ClaimedRow) -> Delivered:
        counts["deliveries"] += 1
        key = claimed.ordering_key or ""
        if key in flying:
            overlaps.append((key, flying[key], claimed.id))
        flying[key] = claimed.id
        try:
            await asyncio.sleep(rng.uniform(0, 0.004))
            if rng.random() < 0.5:
                raise ValueError("poison")  # dead-lettered at once (one attempt), replayed below
            return Delivered.NEEDS_STAMP
        finally:
            if flying.get(key) == claimed.id:
                del flying[key]

    async def work(index: int) -> None:
        source = outbox_source(
            container, ScriptedDeliverer(deliver), instance_id=f"w{index}", batch_size=4, max_retries=1
        )
        while not stop.is_set():
            await source.run_cycle()

    async def operator() -> None:
        dead_letters = (
            sa.select(OUTBOX_TABLE.c.id).where(OUTBOX_TABLE.c.dead_lettered_on.is_not(None)).limit(4)
        )
        while not stop.is_set():
            async with container.database().session() as session:
                dead = [r[0] for r in (await session.exec(dead_letters)).all()]  # type: ignore[call-overload]
            for row_id in dead:
                await container.admin().replay("outbox", [str(row_id)], actor="operator")
                counts["replays"] += 1
            await asyncio.sleep(0.002)

    tasks = [asyncio.ensure_future(work(i)) for i in range(3)] + [asyncio.ensure_future(operator())]
    await asyncio.sleep(10)
    stop.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 30)
    assert overlaps == [], f"{len(overlaps)} deliveries overlapped another row of their key"
    # It did race: about 800 deliveries and 400 replays here.
    assert counts["deliveries"] > 100, counts
    assert counts["replays"] > 20, counts


@pytest.mark.postgres
async def test_a_replay_whose_process_froze_holds_the_relay_only_for_the_idle_timeout(
    postgres_url: str,
) -> None:
    """A replay transaction left open (its process frozen after it took the gate) ends after
    ``DATABASE__BOOKKEEPING_IDLE_TIMEOUT_SECONDS``; the claims that waited for it then go on."""
    container = kit_container(make_settings(postgres_url, database={"bookkeeping_idle_timeout_seconds": 1}))
    try:
        clock = FakeClock()
        dead, _ = await a_dead_head_and_its_successor(container, OUTBOX_TABLE, clock.now)
        await insert_rows(container, [row("kit.free.v1", clock.now)])
        frozen = container.database().session()
        session = await frozen.__aenter__()
        await return_to_pending(
            session, OUTBOX, [dead], EVERY_TENANT, gate_idle_timeout_seconds=1
        )  # ... and the process stops here, its transaction open
        claim = outbox_source(container, ScriptedDeliverer(), clock).claim(uuid.uuid4())
        claimed = await asyncio.wait_for(claim, 15)
        assert [r.name for r in claimed] == ["kit.k.v1", "kit.free.v1"]  # the replay was rolled back
        with contextlib.suppress(DBAPIError):
            await frozen.__aexit__(None, None, None)
    finally:
        await container.database().dispose()


def stop_after_commit(source: Any, cycle: Callable[[], asyncio.Task[Any]]) -> None:
    """Make ``source``'s claim be interrupted after it committed: the stop lands as the rows
    come back from the database (where a connection returns to its pool)."""
    original = source.claim

    async def claim_then_stop(token: uuid.UUID, now: datetime | None = None) -> list[ClaimedRow]:
        rows: list[ClaimedRow] = await original(token, now)
        cycle().cancel()
        await asyncio.sleep(0.05)  # the rows' way back to the cycle, where the stop arrives
        return rows

    source.claim = claim_then_stop


async def test_a_stop_right_after_the_claim_committed_gives_the_batch_back(
    container: OutboxContainer,
) -> None:
    clock = FakeClock()
    ids = await insert_rows(container, [row("kit.a.v1", clock.now) for _ in range(10)])
    deliverer = ScriptedDeliverer()
    source = outbox_source(container, deliverer, clock, batch_size=10, shutdown_timeout_seconds=5)
    cycle: asyncio.Task[Any] | None = None
    stop_after_commit(source, lambda: cycle)  # type: ignore[arg-type,return-value]
    cycle = asyncio.create_task(source.run_cycle())
    with pytest.raises(asyncio.CancelledError):
        await cycle
    assert deliverer.delivered == []
    await given_back(container, ids, clock)


async def given_back(container: OutboxContainer, ids: list[uuid.UUID], clock: FakeClock) -> None:
    """The rows are free, uncharged, and claimable again at once (not after the lease)."""
    for row_id in ids:
        current = await state(container, row_id)
        assert (current.lock_token, current.locked_until, current.locked_by) == (None, None, None)
        assert (current.retry_count, current.processed_on, current.last_error) == (0, None, None)
    again = await outbox_source(container, ScriptedDeliverer(), clock, batch_size=10).claim(uuid.uuid4())
    assert sorted(r.id for r in again) == sorted(ids)


async def test_a_claim_whose_commit_lands_after_the_stop_cancelled_it_is_given_back(
    container: OutboxContainer,
) -> None:
    """A claim that has not answered within half the deadline is cancelled, but its COMMIT may
    already be with the server and land afterwards. A release that did not wait for the
    cancelled claim read the table before that commit, found nothing, and left the batch leased
    for a whole lease; the release now waits for the claim to end (within the deadline)."""
    clock = FakeClock()
    ids = await insert_rows(container, [row("kit.a.v1", clock.now) for _ in range(10)])
    source = outbox_source(container, ScriptedDeliverer(), clock, batch_size=10, shutdown_timeout_seconds=2)
    real_claim, real_release = source.claim, source.leases.release_claimed
    claiming, released = asyncio.Event(), asyncio.Event()

    async def commits_after_the_cancel(token: uuid.UUID, now: datetime | None = None) -> list[ClaimedRow]:
        claiming.set()
        try:
            await asyncio.sleep(30)  # no answer within half the deadline: the stop cancels it ...
        except asyncio.CancelledError:
            # ... while its COMMIT is on its way: it lands after a release that does not wait for
            # it, and before one that does (which would wait for it the whole 0.2 s).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(released.wait(), 0.2)
            await real_claim(token, now)
            raise
        return []

    async def noted_release(*args: Any) -> set[uuid.UUID]:
        given = await real_release(*args)
        released.set()
        return given

    source.claim = commits_after_the_cancel  # type: ignore[method-assign]
    source.leases.release_claimed = noted_release  # type: ignore[method-assign]
    cycle = asyncio.create_task(source.run_cycle())
    await asyncio.wait_for(claiming.wait(), 10)
    cycle.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cycle
    assert released.is_set()
    await given_back(container, ids, clock)


async def test_a_stop_during_a_claim_that_hangs_ends_within_the_shutdown_timeout(
    container: OutboxContainer,
) -> None:
    """The claim is let finish only within the shutdown deadline (a database that stopped
    answering must not hold the process): the cycle ends, and the rows wait out their lease."""
    clock = FakeClock()
    await insert_rows(container, [row("kit.a.v1", clock.now)])
    source = outbox_source(container, ScriptedDeliverer(), clock, shutdown_timeout_seconds=1.0)
    claiming = asyncio.Event()

    async def hangs(token: uuid.UUID, now: datetime | None = None) -> list[ClaimedRow]:
        del token, now
        claiming.set()
        await asyncio.sleep(30)  # a claim whose database stopped answering
        return []

    source.claim = hangs  # type: ignore[method-assign]
    cycle = asyncio.create_task(source.run_cycle())
    await asyncio.wait_for(claiming.wait(), 10)
    started = asyncio.get_running_loop().time()
    cycle.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cycle
    assert asyncio.get_running_loop().time() - started < 2.5  # the deadline is 1 s


@pytest.mark.postgres
@pytest.mark.parametrize("race_url", ["repeatable-read"], indirect=True)
async def test_every_session_of_the_service_runs_read_committed_whatever_the_database_default(
    pg_container: OutboxContainer, control: AsyncConnection
) -> None:
    """The claim's key guard and the replay gate rely on READ COMMITTED (each statement sees
    what committed before it began); the service sets it rather than assume the server's
    default: its sessions, its bookkeeping transactions and its autocommit statements."""
    assert (await control.exec_driver_sql("SHOW transaction_isolation")).scalar_one() == "repeatable read"
    database = pg_container.database()
    show = sa.text("SHOW transaction_isolation")
    async with database.session() as session:
        assert (await session.exec(show)).scalar_one() == "read committed"  # type: ignore[call-overload]
    async with database.bookkeeping() as connection:
        assert (await connection.execute(show)).scalar_one() == "read committed"
    async with database.bookkeeping_statement() as connection:
        assert (await connection.execute(show)).scalar_one() == "read committed"
