"""The relay's hot path: what its shortcuts skip and what they must still guarantee.

* a publish skips the lease renewal only while the claim's lease is young; a frozen or slow
  cycle still renews, and the renewal still finds a lost row;
* stamps that finish together share one statement, and each row learns its own outcome (a
  re-claimed row is not stamped; a failed statement fails every stamp of its group; a dropped
  connection is tried again);
* an empty table waits the idle interval only while the wake is reliable;
* the claim's plan on PostgreSQL uses its indexes, so a schema change cannot make it a scan;
  so does the release of a claim a stop interrupted.

Timing is not asserted here (that is ``make bench``): statements, rows and plans are.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Iterable
from datetime import datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from outbox_kit.persistence.tables import OUTBOX_TABLE, LeaseStore
from outbox_kit.processor.claim import ClaimedRow
from outbox_kit.processor.cycle import TableSource
from outbox_kit.processor.processor import CycleResult, Processor
from outbox_kit.runtime.container import OutboxContainer
from outbox_kit.testing.fixtures import kit_container, make_settings
from outbox_kit.testing.harness import FakeClock, ScriptedDeliverer, insert_rows, outbox_source, row, state
from outbox_kit.transports.bus import Delivered
from sqlalchemy.ext.asyncio import AsyncConnection


async def claim_all(source: TableSource) -> tuple[list[ClaimedRow], uuid.UUID]:
    token = uuid.uuid4()
    return await source.claim(token), token


async def take_over(container: OutboxContainer, row_id: uuid.UUID) -> None:
    async with container.database().session() as session:
        await session.exec(  # type: ignore[call-overload]
            OUTBOX_TABLE.update().where(OUTBOX_TABLE.c.id == row_id).values(lock_token=uuid.uuid4())
        )
        await session.commit()


async def test_a_publish_renews_only_when_its_lease_might_not_outlast_its_time_limit(
    container: OutboxContainer,
) -> None:
    """A 60 s lease and a 20 s delivery time limit with its 12 s margin: renewed below 32 s."""
    clock = FakeClock()
    young_id, old_id, lost_id = await insert_rows(container, [row("kit.a.v1", clock.now) for _ in range(3)])
    deliverer = ScriptedDeliverer(fresh_lease=False)
    limits = {"lease_seconds": 60, "delivery_timeout_seconds": 20, "renew_below_seconds": 32}
    source = outbox_source(container, deliverer, clock, **limits)
    (young, old, lost), token = await claim_all(source)
    claimed_until = (await state(container, young_id)).locked_until

    clock.advance(20)  # 40 s of 60 left: no renewal, the claim's lease stands
    assert await source._process(young, token)
    assert (await state(container, young_id)).processed_on is not None
    assert deliverer.delivered[-1].locked_until == claimed_until

    clock.advance(15)  # 25 s left, under 32: renewed to a whole lease before the publish
    assert await source._process(old, token)
    assert (await state(container, old_id)).processed_on is not None

    await take_over(container, lost_id)  # another replica took it while this cycle was slow
    assert not await source._process(lost, token)
    assert [r.id for r in deliverer.delivered] == [young_id, old_id]  # the lost one never published


async def test_handler_rows_always_get_a_whole_lease_first(container: OutboxContainer) -> None:
    clock = FakeClock()
    (row_id,) = await insert_rows(container, [row("kit.a.v1", clock.now)])
    seen: list[Any] = []

    async def handler(claimed: ClaimedRow) -> Delivered:
        seen.append((await state(container, claimed.id)).locked_until)
        return Delivered.NEEDS_STAMP

    source = outbox_source(container, ScriptedDeliverer(handler, fresh_lease=True), clock, lease_seconds=60)
    (claimed,), token = await claim_all(source)
    clock.advance(1)
    assert await source._process(claimed, token)
    assert seen == [clock.now + timedelta(seconds=60)]
    assert (await state(container, row_id)).processed_on is not None


async def test_stamps_finishing_together_share_one_statement_and_each_learns_its_own(
    container: OutboxContainer,
) -> None:
    clock = FakeClock()
    ids = await insert_rows(container, [row("kit.a.v1", clock.now) for _ in range(6)])
    source = outbox_source(container, ScriptedDeliverer(), clock)
    rows, token = await claim_all(source)
    await take_over(container, ids[2])
    stamps = source.outcomes.stamps
    before = stamps.statements

    results = await asyncio.gather(*(stamps.stamp(r.id, token) for r in rows))

    assert stamps.statements == before + 1
    assert dict(zip([r.id for r in rows], results, strict=True)) == {i: i != ids[2] for i in ids}
    stamped = [(await state(container, i)).processed_on is not None for i in ids]
    assert stamped == [i != ids[2] for i in ids]


@pytest.mark.postgres
async def test_a_batch_is_stamped_in_groups_of_its_concurrency_with_its_last_group_at_once(
    postgres_url: str,
) -> None:
    """20 rows, 8 publishes at a time, the confirms coming 4 ms apart: the stamps go in groups
    of 8 and the batch's last group as soon as its last delivery ended, at most 4 statements in
    all (grouped by a 5 ms window they took one statement per row or two)."""
    container = kit_container(make_settings(postgres_url))
    try:
        clock = FakeClock()
        await insert_rows(container, [row("kit.a.v1", clock.now) for _ in range(20)])
        confirmed: list[int] = []

        async def publish(claimed: ClaimedRow) -> Delivered:
            del claimed
            confirmed.append(len(confirmed))
            await asyncio.sleep(0.004 * len(confirmed))
            return Delivered.NEEDS_STAMP

        deliverer = ScriptedDeliverer(publish, fresh_lease=False)
        source = outbox_source(container, deliverer, clock, batch_size=20, delivery_concurrency=8)
        before = source.outcomes.stamps.statements
        result = await source.run_cycle()
        assert result.completed == 20
        assert source.outcomes.stamps.statements - before <= 4
        assert [(await state(container, r.id)).processed_on is not None for r in deliverer.delivered] == [
            True
        ] * 20
    finally:
        await container.database().dispose()


async def test_a_failed_group_fails_every_stamp_in_it(
    container: OutboxContainer, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FakeClock()
    ids = await insert_rows(container, [row("kit.a.v1", clock.now) for _ in range(3)])
    source = outbox_source(container, ScriptedDeliverer(), clock)
    rows, token = await claim_all(source)

    async def refused(*_args: object, **_kwargs: object) -> set[uuid.UUID]:
        raise ConnectionResetError("database went away")

    monkeypatch.setattr(LeaseStore, "stamp_processed", refused)
    results = await asyncio.gather(
        *(source.outcomes.stamps.stamp(r.id, token) for r in rows), return_exceptions=True
    )
    assert [type(result) for result in results] == [ConnectionResetError] * 3
    assert [(await state(container, i)).processed_on for i in ids] == [None] * 3  # they come back


class EmptySource:
    name = "empty"

    async def run_cycle(self) -> CycleResult:
        return CycleResult()

    async def next_due(self) -> datetime | None:
        return None


def dropped_connection() -> sa.exc.DBAPIError:
    return sa.exc.DBAPIError("UPDATE", {}, Exception("terminating connection"), connection_invalidated=True)


@pytest.mark.parametrize("written", [False, True], ids=["lost", "written-but-unanswered"])
async def test_a_group_whose_connection_dropped_is_written_on_a_fresh_one(
    container: OutboxContainer, monkeypatch: pytest.MonkeyPatch, written: bool
) -> None:
    """A terminated connection (a failover, ``pg_terminate_backend``) does not leave a group of
    confirmed rows to be published again: the flush is tried again, and a row the dropped
    attempt did write is still reported as ours."""
    clock = FakeClock()
    ids = await insert_rows(container, [row("kit.a.v1", clock.now) for _ in range(3)])
    source = outbox_source(container, ScriptedDeliverer(), clock)
    rows, token = await claim_all(source)
    original = LeaseStore.stamp_processed
    attempts: list[int] = []

    async def drops_the_first(self: LeaseStore, *args: Any, **kwargs: Any) -> set[uuid.UUID]:
        attempts.append(1)
        if len(attempts) == 1:
            if written:
                await original(self, *args, **kwargs)
            raise dropped_connection()
        return await original(self, *args, **kwargs)

    monkeypatch.setattr(LeaseStore, "stamp_processed", drops_the_first)
    results = await asyncio.gather(*(source.outcomes.stamps.stamp(r.id, token) for r in rows))
    assert results == [True, True, True]
    assert len(attempts) == 2
    assert all([(await state(container, i)).processed_on is not None for i in ids])


async def test_a_group_the_database_keeps_refusing_fails_after_its_retries(
    container: OutboxContainer, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FakeClock()
    ids = await insert_rows(container, [row("kit.a.v1", clock.now)])
    source = outbox_source(container, ScriptedDeliverer(), clock)
    (claimed,), token = await claim_all(source)
    attempts: list[int] = []

    async def always_dropped(*_args: object, **_kwargs: object) -> set[uuid.UUID]:
        attempts.append(1)
        raise dropped_connection()

    monkeypatch.setattr(LeaseStore, "stamp_processed", always_dropped)
    with pytest.raises(sa.exc.DBAPIError):
        await source.outcomes.stamps.stamp(claimed.id, token)
    assert len(attempts) == 3
    assert (await state(container, ids[0])).processed_on is None  # it comes back at its lease end


@pytest.mark.parametrize(
    ("claimed", "reliable", "expected"),
    [(0, True, 10.0), (0, False, 2.0), (3, True, 2.0)],
    ids=["empty-and-listening", "empty-without-listener", "rows-were-claimed"],
)
async def test_an_empty_table_waits_the_idle_interval_only_while_the_wake_is_reliable(
    claimed: int, reliable: bool, expected: float
) -> None:
    loop = Processor(
        EmptySource(),
        wake=asyncio.Event(),
        interval_seconds=2.0,
        clock=FakeClock(),
        idle_interval_seconds=10.0,
        wake_is_reliable=lambda: reliable,
    )
    assert await loop._smart_wait(CycleResult(claimed=claimed)) == expected


@pytest.mark.postgres
async def test_the_claim_plan_uses_indexes_not_a_scan_of_the_outbox(postgres_url: str) -> None:
    """With enough rows that a scan would be the wrong plan, the claim must find its rows
    through indexes: a migration that drops or changes them shows here, not in production."""
    container = kit_container(make_settings(postgres_url))
    try:
        clock = FakeClock()
        await insert_rows(container, [row("kit.a.v1", clock.now) for _ in range(50)])
        await insert_rows(container, [row("kit.k.v1", clock.now, key=f"k-{i % 10}") for i in range(50)])
        await processed_history(container)
        source = outbox_source(container, ScriptedDeliverer(), clock)
        plan = await explained(container, source)
        assert "Seq Scan on outbox_messages" not in plan, plan
        assert "Index" in plan, plan
    finally:
        await container.database().dispose()


@pytest.mark.postgres
async def test_the_release_of_an_interrupted_claim_uses_an_index_not_a_scan_of_the_outbox(
    postgres_url: str,
) -> None:
    """A stop during the claim gives the batch back by its token within half the shutdown
    deadline: on a table with a long processed history a scan would not finish in time, and the
    batch would stay leased for a whole lease."""
    container = kit_container(make_settings(postgres_url))
    try:
        clock = FakeClock()
        await insert_rows(container, [row("kit.a.v1", clock.now) for _ in range(50)])
        source = outbox_source(container, ScriptedDeliverer(), clock, batch_size=10)
        token = uuid.uuid4()
        until = (await source.claim(token))[0].locked_until
        await processed_history(container)
        lines = await explained_statement(
            container, lambda connection: source.leases.release_claimed(connection, token, until)
        )
        plan = "\n".join(sorted(lines))
        assert "Seq Scan on outbox_messages" not in plan, plan
        assert "ix_outbox_messages_pending_locked" in plan, plan
    finally:
        await container.database().dispose()


async def processed_history(container: OutboxContainer) -> None:
    """20,000 processed rows, analyzed: enough that a scan of the table is never the cheap plan."""
    async with container.database().bookkeeping() as connection:
        await connection.execute(
            sa.text(
                "INSERT INTO outbox_messages (id, seq, event_name, kind, payload, occurred_on, "
                "available_on, processed_on, retry_count) "
                "SELECT gen_random_uuid(), nextval(pg_get_serial_sequence('outbox_messages', 'seq')), "
                "'kit.done.v1', 'integration', '{}', now(), now(), now(), 0 "
                "FROM generate_series(1, 20000)"
            )
        )
        await connection.execute(sa.text("ANALYZE outbox_messages"))


async def explained_statement(
    container: OutboxContainer, run: Callable[[AsyncConnection], Awaitable[Iterable[Any]]]
) -> list[str]:
    """The plan of whatever ``run`` executes on a bookkeeping connection (``EXPLAIN`` is put in
    front of it on its way to the driver: planned, never run); ``run`` returns its rows."""
    engine = container.database().bookkeeping_engine.sync_engine

    def explain(*args: Any) -> tuple[str, Any]:
        statement, parameters = args[2], args[3]
        return f"EXPLAIN (COSTS OFF) {statement}", parameters

    sa.event.listen(engine, "before_cursor_execute", explain, retval=True)
    try:
        async with container.database().bookkeeping() as connection:
            return [str(line[0]) if isinstance(line, sa.Row) else str(line) for line in await run(connection)]
    finally:
        sa.event.remove(engine, "before_cursor_execute", explain)


async def explained(container: OutboxContainer, source: TableSource) -> str:
    """The plan of the real claim statement with its real parameters."""
    clock = FakeClock()
    params = {"now": clock.now, "lease_until": clock.now, "token": uuid.uuid4(), "locked_by": "plan"}

    async def claim(connection: AsyncConnection) -> list[Any]:
        return list((await connection.execute(source._claimer.statement, params)).all())

    return "\n".join(await explained_statement(container, claim))
