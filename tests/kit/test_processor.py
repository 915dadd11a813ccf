"""The delivery side (issue: processor), on SQLite and PostgreSQL, driven by a fake clock."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlparse

import pytest
import sqlalchemy as sa
from outbox_kit.application.handlers import HandlerRegistryError
from outbox_kit.domain import (
    DomainEvent,
)
from outbox_kit.persistence.tables import (
    OUTBOX_TABLE,
)
from outbox_kit.processor.claim import ClaimedRow
from outbox_kit.processor.processor import (
    Processor,
)
from outbox_kit.runtime.container import OutboxContainer
from outbox_kit.testing.fixtures import (
    SERVICE_URLS,
    ContainerFactory,
    acting_as,
    eventually,
    kit_container,
    make_settings,
)
from outbox_kit.testing.harness import (
    Counter,
    CounterChangedV1,
    Counters,
    Created,
    FakeClock,
    ScriptedDeliverer,
    all_rows,
    insert_rows,
    install_kit,
    outbox_source,
    row,
    state,
    tcp_proxy,
)
from outbox_kit.transports.bus import CircuitOpenError, Delivered
from sqlalchemy.exc import DBAPIError

pytestmark = pytest.mark.integration


async def fail(row_: ClaimedRow) -> Delivered:
    msg = f"broker said no to {row_.name}"
    raise ConnectionError(msg)


async def test_a_claimed_row_is_leased_to_exactly_one_claimer(container: OutboxContainer) -> None:
    clock = FakeClock()
    ids = await insert_rows(container, [row("kit.a.v1", clock.now) for _ in range(3)])
    first = await outbox_source(container, ScriptedDeliverer(), clock).claim(uuid.uuid4())
    second = await outbox_source(container, ScriptedDeliverer(), clock).claim(uuid.uuid4())
    assert sorted(r.id for r in first) == sorted(ids)
    assert second == []


async def test_failures_back_off_with_jitter_and_dead_letter_after_exactly_max_retries(
    container: OutboxContainer, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    (row_id,) = await insert_rows(container, [row("kit.a.v1", clock.now)])
    deliverer = ScriptedDeliverer(fail)
    source = outbox_source(
        container, deliverer, clock, max_retries=3, retry_backoff_base_seconds=10, lease_seconds=300
    )
    for attempt, nominal in ((1, 10), (2, 20)):
        await source.run_cycle()
        current = await state(container, row_id)
        assert current.retry_count == attempt
        assert "broker said no" in current.last_error
        wait = (current.locked_until - clock.now).total_seconds()
        assert nominal * 0.8 <= wait <= nominal * 1.2
        assert current.lock_token is None  # backing off, not leased
        assert (await source.claim(uuid.uuid4())) == []  # not before the backoff ends
        clock.advance(wait + 0.001)
    with caplog.at_level(logging.ERROR):
        await source.run_cycle()
    final = await state(container, row_id)
    assert (final.retry_count, final.dead_letter_reason) == (3, "retries_exhausted")
    assert final.dead_lettered_on is not None
    assert f"{row_id}" in caplog.text
    assert "dead-lettered (retries_exhausted)" in caplog.text
    assert len(deliverer.delivered) == 3
    counter = container.metrics().dead_letters.labels("outbox", "retries_exhausted")
    assert counter._value.get() == 1


async def test_an_unresolvable_name_is_retried_once_then_dead_lettered(container: OutboxContainer) -> None:
    clock = FakeClock()
    (row_id,) = await insert_rows(container, [row("kit.never-registered.v1", clock.now)])
    source = outbox_source(container, container.outbox_deliverer(), clock)
    await source.run_cycle()
    first = await state(container, row_id)
    assert (first.retry_count, first.dead_lettered_on) == (1, None)
    assert "no registered message is named 'kit.never-registered.v1'" in first.last_error
    clock.advance(3600)
    await source.run_cycle()
    second = await state(container, row_id)
    assert second.dead_letter_reason == "type_unresolvable"


async def test_an_unresolvable_name_after_other_failures_still_gets_its_one_retry(
    container: OutboxContainer,
) -> None:
    """Three earlier attempts failed for another reason (the broker refused, say); the first
    time the name does not resolve is still only the first miss."""
    clock = FakeClock()
    (row_id,) = await insert_rows(
        container,
        [row("kit.never-registered.v1", clock.now, retry_count=3, last_error="ConnectionError: refused")],
    )
    source = outbox_source(container, container.outbox_deliverer(), clock)
    await source.run_cycle()
    first = await state(container, row_id)
    assert (first.retry_count, first.dead_lettered_on) == (4, None)
    clock.advance(3600)
    await source.run_cycle()
    second = await state(container, row_id)
    assert (second.retry_count, second.dead_letter_reason) == (5, "type_unresolvable")


@dataclass(frozen=True, kw_only=True)
class RenamedV2(DomainEvent, name="kit.renamed.v2"):
    full_name: str


def renamed_v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    kept = {key: value for key, value in payload.items() if key != "name"}
    return {**kept, "full_name": str(payload["name"]).title()}


async def test_a_stored_v1_row_is_delivered_as_the_upcast_v2_class(container: OutboxContainer) -> None:
    """A row written by the previous version of the service (v1 name and payload) reaches the
    handler of today's v2 class, through the upcaster the module declares."""
    registry = container.registry()
    registry.register(RenamedV2)
    registry.add_upcaster("kit.renamed.v1", "kit.renamed.v2", renamed_v1_to_v2)
    registry.validate()
    seen: list[Any] = []

    async def handler(event: RenamedV2, uow: Any) -> None:
        seen.append(event)

    container.handlers().on_domain_event(RenamedV2, handler)
    clock = FakeClock()
    payload = {"aggregate_id": "a-1", "name": "ada lovelace", "occurred_on": clock.now.isoformat()}
    stored = row("kit.renamed.v1", clock.now, kind="domain", payload=payload)
    (row_id,) = await insert_rows(container, [stored])
    await outbox_source(container, container.outbox_deliverer(), clock).run_cycle()
    assert [(type(event), event.full_name, event.aggregate_id) for event in seen] == [
        (RenamedV2, "Ada Lovelace", "a-1")
    ]
    assert (await state(container, row_id)).processed_on is not None


async def test_max_retries_one_means_no_retry_even_for_unresolvable(container: OutboxContainer) -> None:
    clock = FakeClock()
    (row_id,) = await insert_rows(container, [row("kit.never-registered.v1", clock.now)])
    await outbox_source(container, container.outbox_deliverer(), clock, max_retries=1).run_cycle()
    assert (await state(container, row_id)).dead_letter_reason == "type_unresolvable"


async def test_the_lease_is_renewed_before_dispatch_and_a_lost_row_is_skipped(
    container: OutboxContainer,
) -> None:
    clock = FakeClock()
    first_id, second_id = await insert_rows(container, [row("kit.a.v1", clock.now) for _ in range(2)])
    thief = uuid.uuid4()
    renewed: list[Any] = []

    async def slow_then_steal(claimed: ClaimedRow) -> Delivered:
        renewed.append((await state(container, claimed.id)).locked_until)
        async with container.database().session() as session:  # another replica took row 2
            from outbox_kit.persistence.tables import OUTBOX_TABLE

            await session.exec(  # type: ignore[call-overload]
                OUTBOX_TABLE.update().where(OUTBOX_TABLE.c.id == second_id).values(lock_token=thief)
            )
            await session.commit()
        return Delivered.NEEDS_STAMP

    deliverer = ScriptedDeliverer(slow_then_steal)
    source = outbox_source(container, deliverer, clock, lease_seconds=60)
    claimed = await source.claim(uuid.uuid4())
    clock.advance(50)  # most of the claim lease is gone when the row's turn comes
    for item in claimed:
        await source._process(item, claimed_token(item, source))
    assert [r.id for r in deliverer.delivered] == [first_id]
    assert renewed[0] == clock.now + timedelta(seconds=60)
    assert (await state(container, first_id)).processed_on is not None
    lost = await state(container, second_id)
    assert (lost.lock_token, lost.processed_on) == (thief, None)


async def test_a_lease_lost_after_delivery_is_counted_and_not_stamped(
    container: OutboxContainer, caplog: pytest.LogCaptureFixture
) -> None:
    """Another replica re-claimed the row while this one published it: the stamp matches
    nothing, the row stays the new owner's (it may deliver again; consumers dedupe), and the
    loss is a Warning and a ``outbox_lost_leases_total`` increment."""
    clock = FakeClock()
    (row_id,) = await insert_rows(container, [row("kit.a.v1", clock.now)])
    thief = uuid.uuid4()

    async def publish_while_another_replica_takes_over(claimed: ClaimedRow) -> Delivered:
        await take_over(container, claimed.id, thief)
        return Delivered.NEEDS_STAMP  # published; the stamp comes next

    source = outbox_source(container, ScriptedDeliverer(publish_while_another_replica_takes_over), clock)
    registry = container.metrics().registry
    before = registry.get_sample_value("outbox_lost_leases_total", {"source": "outbox"}) or 0.0
    with caplog.at_level(logging.WARNING):
        cycle = await source.run_cycle()

    # Published, but the row is the new owner's now: not this processor's progress (the
    # re-poll decision counts only rows it finished).
    assert cycle.completed == 0
    taken = await state(container, row_id)
    assert (taken.lock_token, taken.processed_on, taken.retry_count) == (thief, None, 0)
    assert registry.get_sample_value("outbox_lost_leases_total", {"source": "outbox"}) == before + 1
    assert any("lease lost after delivery" in r.getMessage() for r in caplog.records)


async def take_over(container: OutboxContainer, row_id: uuid.UUID, token: uuid.UUID) -> None:
    """What another replica's claim does to a row: its own token on it."""
    async with container.database().session() as session:
        await session.exec(  # type: ignore[call-overload]
            OUTBOX_TABLE.update().where(OUTBOX_TABLE.c.id == row_id).values(lock_token=token)
        )
        await session.commit()


@pytest.mark.postgres
async def test_a_claim_skips_rows_another_transaction_holds_instead_of_waiting(postgres_url: str) -> None:
    """``FOR UPDATE SKIP LOCKED``: while another transaction holds two rows (a replica mid-claim),
    a claim takes the other two at once instead of queueing behind the lock."""
    container = kit_container(make_settings(postgres_url))
    try:
        clock = FakeClock()
        ids = await insert_rows(container, [row("kit.a.v1", clock.now) for _ in range(4)])
        source = outbox_source(container, ScriptedDeliverer(), clock)
        async with container.database().engine.connect() as replica:
            await replica.execute(
                sa.select(OUTBOX_TABLE.c.id).where(OUTBOX_TABLE.c.id.in_(ids[:2])).with_for_update()
            )
            during = await asyncio.wait_for(source.claim(uuid.uuid4()), timeout=10)
            await replica.rollback()
        after = await source.claim(uuid.uuid4())
        assert sorted(r.id for r in during) == sorted(ids[2:])
        assert sorted(r.id for r in after) == sorted(ids[:2])  # free again once the lock is gone
    finally:
        await container.database().dispose()


def claimed_token(item: ClaimedRow, source: Any) -> uuid.UUID:
    return source.last_token  # set by the claim helper below


@pytest.fixture(autouse=True)
def _remember_claim_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    from outbox_kit.processor.cycle import (
        TableSource,
    )

    original = TableSource.claim

    async def claim(self: TableSource, token: uuid.UUID, now: datetime | None = None) -> list[ClaimedRow]:
        self.last_token = token  # type: ignore[attr-defined]
        return await original(self, token, now)

    monkeypatch.setattr(TableSource, "claim", claim)


async def test_an_outcome_lands_after_an_expired_but_unclaimed_lease(container: OutboxContainer) -> None:
    clock = FakeClock()
    (row_id,) = await insert_rows(container, [row("kit.a.v1", clock.now)])

    async def outlives_the_lease(_row: ClaimedRow) -> Delivered:
        clock.advance(120)
        return Delivered.NEEDS_STAMP

    await outbox_source(container, ScriptedDeliverer(outlives_the_lease), clock, lease_seconds=30).run_cycle()
    assert (await state(container, row_id)).processed_on is not None


async def test_a_keyed_row_waits_for_its_head_and_a_batch_holds_one_row_per_key(
    container: OutboxContainer,
) -> None:
    clock = FakeClock()
    keyed = await insert_rows(container, [row("kit.k.v1", clock.now, key="order-1") for _ in range(4)])
    keyless = await insert_rows(container, [row("kit.free.v1", clock.now) for _ in range(3)])
    other = await insert_rows(container, [row("kit.k.v1", clock.now, key="order-2")])
    claimed = await outbox_source(container, ScriptedDeliverer(), clock, batch_size=10).claim(uuid.uuid4())
    assert sorted(r.id for r in claimed) == sorted([keyed[0], *keyless, *other])


async def test_order_per_key_holds_and_a_dead_lettered_head_releases_the_key(
    container: OutboxContainer,
) -> None:
    clock = FakeClock()
    poison, *rest = await insert_rows(container, [row("kit.k.v1", clock.now, key="k") for _ in range(3)])

    async def poison_fails(claimed: ClaimedRow) -> Delivered:
        if claimed.id == poison:
            raise ValueError("poison")
        return Delivered.NEEDS_STAMP

    deliverer = ScriptedDeliverer(poison_fails)
    source = outbox_source(container, deliverer, clock, max_retries=2, retry_backoff_base_seconds=1)
    for _ in range(6):
        await source.run_cycle()
        clock.advance(2)
    order = [r.id for r in deliverer.delivered]
    assert order == [poison, poison, *rest]
    assert (await state(container, poison)).dead_letter_reason == "retries_exhausted"


async def test_a_replayed_head_waits_while_a_later_row_of_its_key_is_in_flight(
    container: OutboxContainer,
) -> None:
    """A dead-lettered head releases its key, so the next row of the key runs. Replaying the
    dead letter while that row is in flight must not put two rows of one key in flight at once
    (on two processors): the replayed row is claimed only once its key-mate has finished."""
    clock = FakeClock()
    poison, later = await insert_rows(container, [row("kit.k.v1", clock.now, key="k") for _ in range(2)])
    in_flight, finish = asyncio.Event(), asyncio.Event()

    async def poison_fails_later_hangs(claimed: ClaimedRow) -> Delivered:
        if claimed.id == poison:
            raise ValueError("poison")
        in_flight.set()
        await finish.wait()
        return Delivered.NEEDS_STAMP

    source = outbox_source(container, ScriptedDeliverer(poison_fails_later_hangs), clock, max_retries=1)
    await source.run_cycle()
    assert (await state(container, poison)).dead_letter_reason == "retries_exhausted"
    first = asyncio.create_task(source.run_cycle())
    await asyncio.wait_for(in_flight.wait(), 10)
    await container.admin().replay("outbox", [str(poison)], actor="test")
    replica = outbox_source(container, ScriptedDeliverer(), clock)
    assert await replica.claim(uuid.uuid4()) == [], "two rows of key 'k' in flight at once"
    waiting = await container.admin().explain("outbox", str(poison))
    assert waiting.state == "blocked"
    assert f"row {later} " in waiting.detail
    finish.set()
    await first
    assert (await state(container, later)).processed_on is not None
    assert [claimed.id for claimed in await replica.claim(uuid.uuid4())] == [poison]


async def test_a_hot_key_does_not_starve_unrelated_rows(container: OutboxContainer) -> None:
    clock = FakeClock()
    await insert_rows(container, [row("kit.hot.v1", clock.now, key="hot") for _ in range(2000)])
    unrelated = set(
        await insert_rows(container, [row("kit.cold.v1", clock.now, key=f"k{i % 10}") for i in range(50)])
    )
    unrelated |= set(await insert_rows(container, [row("kit.free.v1", clock.now) for _ in range(50)]))
    deliverer = ScriptedDeliverer()
    source = outbox_source(container, deliverer, clock, batch_size=50)
    cycles = 0
    while not unrelated <= {r.id for r in deliverer.delivered}:
        await source.run_cycle()
        cycles += 1
        assert cycles <= 12, "unrelated rows waited behind the hot key"
    hot_delivered = sum(1 for r in deliverer.delivered if r.ordering_key == "hot")
    assert hot_delivered <= cycles  # one hot row per cycle: strict order, never a full batch


@pytest.mark.redis
async def test_a_real_broker_outage_opens_the_circuit_and_charges_no_retry(
    make_container: ContainerFactory,
) -> None:
    """The whole chain, no script: the service's deliverer publishes to a real Redis through a
    line the test cuts. The outage opens the breaker, the rows are paused with no retry charged,
    and once the line is back they are delivered."""
    redis = urlparse(SERVICE_URLS["redis"])
    async with tcp_proxy(redis.hostname or "127.0.0.1", redis.port or 6379) as proxy:
        container = make_container(
            message_bus={
                "transport": "redis",
                "url": f"redis://127.0.0.1:{proxy.port}",
                "circuit_failure_threshold": 2,
                "circuit_reset_seconds": 0.5,
                "publish_timeout_seconds": 2,
            }
        )
        await install_kit(container)
        with acting_as():
            async with container.units_of_work()() as uow:
                for value in range(3):
                    uow.enqueue(CounterChangedV1(counter_id=f"c-{value}", value=value))
                await uow.commit()
        bus = container.bus()
        await bus.start()
        try:
            await proxy.cut()
            source = outbox_source(container, container.outbox_deliverer(), delivery_concurrency=1)
            await source.run_cycle()
            paused = await all_rows(container)
            assert container.breaker().state == "open"
            charged = [(r.retry_count, r.processed_on, r.dead_lettered_on) for r in paused]
            assert charged == [(0, None, None)] * 3
            assert all(r.locked_until is not None for r in paused)  # paused until the breaker may close
            await proxy.start()  # the broker is back
            for _ in range(100):
                await asyncio.sleep(0.1)
                await source.run_cycle()
                rows = await all_rows(container)
                if all(r.processed_on is not None for r in rows):
                    break
            assert [(r.retry_count, r.processed_on is not None) for r in rows] == [(0, True)] * 3
        finally:
            await bus.stop()
            with contextlib.suppress(Exception):
                await bus.delete_topology()  # type: ignore[attr-defined]


async def test_an_open_circuit_pauses_delivery_without_charging_a_retry(container: OutboxContainer) -> None:
    clock = FakeClock()
    (row_id,) = await insert_rows(container, [row("kit.a.v1", clock.now)])
    reopen = clock.now + timedelta(seconds=30)

    async def circuit_open(_row: ClaimedRow) -> Delivered:
        raise CircuitOpenError(reopen)

    source = outbox_source(container, ScriptedDeliverer(circuit_open), clock)
    await source.run_cycle()
    paused = await state(container, row_id)
    assert (paused.retry_count, paused.lock_token) == (0, None)
    assert paused.locked_until == reopen
    explained = await container.admin().explain("outbox", str(row_id))
    assert explained.state == "paused", explained.detail  # not "backing off after a failure"
    assert "no attempt charged" in explained.detail
    assert f"circuit open until {reopen.isoformat()}" in explained.detail


async def test_a_database_outage_during_a_local_delivery_charges_no_retry(container: OutboxContainer) -> None:
    """The handlers' unit of work lost its connection (a failover): the row is released, not
    charged, and ``explain`` says why it is waiting."""
    clock = FakeClock()
    (row_id,) = await insert_rows(container, [row("kit.a.v1", clock.now, kind="domain")])

    async def database_drops(_row: ClaimedRow) -> Delivered:
        raise DBAPIError(
            "COMMIT", {}, ConnectionResetError("server closed the connection"), connection_invalidated=True
        )

    await outbox_source(container, ScriptedDeliverer(database_drops), clock).run_cycle()
    released = await state(container, row_id)
    assert (released.retry_count, released.lock_token, released.locked_until) == (0, None, None)
    assert released.last_error.startswith("paused, not charged: database unreachable: DBAPIError")


async def test_shutdown_mid_batch_charges_nothing_and_writes_the_earned_outcome(
    container: OutboxContainer,
) -> None:
    clock = FakeClock()
    ids = await insert_rows(container, [row("kit.a.v1", clock.now) for _ in range(3)])
    second_started = asyncio.Event()

    async def hangs_on_the_second(claimed: ClaimedRow) -> Delivered:
        if claimed.id == ids[1]:
            second_started.set()
            await asyncio.Event().wait()  # interrupted by the shutdown
        return Delivered.NEEDS_STAMP

    # One row at a time, so the third row is genuinely "not reached" when the shutdown comes.
    source = outbox_source(
        container,
        ScriptedDeliverer(hangs_on_the_second),
        clock,
        delivery_concurrency=1,
        shutdown_timeout_seconds=0.5,  # the hung delivery is cut short at this deadline
    )
    cycle = asyncio.create_task(source.run_cycle())
    await asyncio.wait_for(second_started.wait(), 10)
    cycle.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cycle
    done, interrupted, unreached = [await state(container, i) for i in ids]
    assert done.processed_on is not None
    for untouched in (interrupted, unreached):
        assert (untouched.processed_on, untouched.lock_token, untouched.locked_until) == (None, None, None)
        assert (untouched.retry_count, untouched.last_error) == (0, None)


async def test_a_delivery_in_flight_at_shutdown_finishes_and_is_stamped(container: OutboxContainer) -> None:
    """A publish under way when the process is told to stop runs on (within the shutdown
    timeout) and its stamp is written: cancelled, the broker could hold a message whose row the
    next worker sends again. The row the cycle had not reached is released untouched."""
    clock = FakeClock()
    ids = await insert_rows(container, [row("kit.a.v1", clock.now) for _ in range(2)])
    publishing = asyncio.Event()

    async def slow_publish(claimed: ClaimedRow) -> Delivered:
        if claimed.id == ids[0]:
            publishing.set()
            await asyncio.sleep(0.3)  # a broker confirm on its way
        return Delivered.NEEDS_STAMP

    source = outbox_source(container, ScriptedDeliverer(slow_publish), clock, delivery_concurrency=1)
    cycle = asyncio.create_task(source.run_cycle())
    await asyncio.wait_for(publishing.wait(), 10)
    cycle.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cycle
    published, unreached = [await state(container, i) for i in ids]
    assert published.processed_on is not None
    assert (unreached.processed_on, unreached.lock_token, unreached.retry_count) == (None, None, 0)


async def test_an_outcome_interrupted_by_shutdown_is_still_written(container: OutboxContainer) -> None:
    clock = FakeClock()
    (row_id,) = await insert_rows(container, [row("kit.a.v1", clock.now)])
    source = outbox_source(container, ScriptedDeliverer(), clock)
    original = source.leases.stamp_processed
    writing = asyncio.Event()

    async def slow_stamp(*args: Any, **kwargs: Any) -> Any:
        writing.set()
        await asyncio.sleep(0.3)
        return await original(*args, **kwargs)

    source.leases.stamp_processed = slow_stamp  # type: ignore[method-assign]
    cycle = asyncio.create_task(source.run_cycle())
    await asyncio.wait_for(writing.wait(), 10)
    cycle.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cycle
    assert (await state(container, row_id)).processed_on is not None


async def test_shutdown_writes_and_release_share_one_deadline(container: OutboxContainer) -> None:
    """The in-flight outcome write and the release of the rest finish within one shutdown
    timeout in all (not one each), so the worker's wait covers the whole cycle."""
    clock = FakeClock()
    ids = await insert_rows(container, [row("kit.a.v1", clock.now) for _ in range(2)])
    source = outbox_source(
        container, ScriptedDeliverer(), clock, delivery_concurrency=1, shutdown_timeout_seconds=1.0
    )
    writing = asyncio.Event()

    async def stalled_stamp(*args: Any, **kwargs: Any) -> Any:
        del args, kwargs
        writing.set()
        await asyncio.sleep(30)  # a database that stopped answering

    async def stalled_release(*args: Any, **kwargs: Any) -> Any:
        del args, kwargs
        await asyncio.sleep(30)

    source.leases.stamp_processed = stalled_stamp  # type: ignore[method-assign]
    source.leases.release = stalled_release  # type: ignore[method-assign]
    cycle = asyncio.create_task(source.run_cycle())
    await asyncio.wait_for(writing.wait(), 10)
    started = time.monotonic()
    cycle.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cycle
    assert time.monotonic() - started < 1.6  # 1 s in all, not 1 s for each of the two steps
    assert [(await state(container, i)).processed_on for i in ids] == [None, None]
    assert not source.outcomes.stamps.flushing  # the stalled stamp did not outlive the cycle


async def test_a_database_error_on_one_row_lets_its_batch_mates_finish(container: OutboxContainer) -> None:
    """One row's outcome cannot be written (the database refused it); the cycle still waits for
    the row delivered beside it, writes that one's stamp, and only then reports the error."""
    clock = FakeClock()
    slow, broken = await insert_rows(container, [row("kit.a.v1", clock.now) for _ in range(2)])

    async def slow_first(claimed: ClaimedRow) -> Delivered:
        if claimed.id == slow:
            await asyncio.sleep(0.3)
        return Delivered.NEEDS_STAMP

    source = outbox_source(container, ScriptedDeliverer(slow_first), clock, delivery_concurrency=2)
    original = source.leases.stamp_processed

    async def refuses_one(connection: Any, row_ids: list[uuid.UUID], *args: Any, **kwargs: Any) -> Any:
        if broken in row_ids:
            msg = "the database refused the write"
            raise ConnectionError(msg)
        return await original(connection, row_ids, *args, **kwargs)

    source.leases.stamp_processed = refuses_one  # type: ignore[method-assign]
    with pytest.raises(ConnectionError, match="refused the write"):
        await source.run_cycle()
    assert (await state(container, slow)).processed_on is not None  # finished before the error
    assert (await state(container, broken)).processed_on is None


async def test_a_row_that_became_due_after_the_claim_looked_is_due_at_once(
    container: OutboxContainer,
) -> None:
    """A lease or a delay that runs out while a slow cycle delivers was not seen by its claim:
    the loop must poll again at once, not sleep its fallback interval (seen in CI: 30 s)."""
    clock = FakeClock()
    lease_end, delay_end = clock.now + timedelta(seconds=0.5), clock.now + timedelta(seconds=0.7)
    leased, delayed = await insert_rows(
        container,
        [
            row("kit.a.v1", clock.now, lock_token=uuid.uuid4(), locked_until=lease_end),
            row("kit.b.v1", clock.now, available_on=delay_end),
        ],
    )
    source = outbox_source(container, ScriptedDeliverer(), clock)
    assert (await source.run_cycle()).completed == 0
    clock.advance(1.0)  # the cycle was slow: both ran out before it ended
    due = await source.next_due()
    assert due is not None, "the loop would sleep its whole interval"
    assert due <= clock.now
    assert (await source.run_cycle()).completed == 2
    assert (await state(container, leased)).processed_on is not None
    assert (await state(container, delayed)).processed_on is not None


async def test_a_row_the_claim_saw_and_left_does_not_make_the_loop_spin(container: OutboxContainer) -> None:
    """A key whose head is leased elsewhere blocks its follower: the follower, due long ago, must
    not make the loop poll again at once; the head's lease end is the next moment."""
    clock = FakeClock()
    lease_end = clock.now + timedelta(seconds=30)
    await insert_rows(
        container,
        [
            row("kit.k.v1", clock.now, key="k", lock_token=uuid.uuid4(), locked_until=lease_end),
            row("kit.k.v1", clock.now, key="k"),
        ],
    )
    source = outbox_source(container, ScriptedDeliverer(), clock)
    assert (await source.run_cycle()).claimed == 0
    clock.advance(1.0)
    assert await source.next_due() == lease_end


async def test_smart_wait_runs_a_retry_on_time_not_one_interval_late(container: OutboxContainer) -> None:
    (row_id,) = await insert_rows(container, [row("kit.a.v1", container.clock()())])
    attempts: list[float] = []

    async def fails_once(_row: ClaimedRow) -> Delivered:
        attempts.append(time.monotonic())
        if len(attempts) == 1:
            raise ConnectionError("first attempt fails")
        return Delivered.NEEDS_STAMP

    source = outbox_source(container, ScriptedDeliverer(fails_once), retry_backoff_base_seconds=0.5)
    loop = Processor(source, wake=asyncio.Event(), interval_seconds=30, clock=container.clock())
    task = asyncio.create_task(loop.run())
    try:
        deadline = time.monotonic() + 10
        while len(attempts) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task  # let it return its connection before the test ends
    assert len(attempts) == 2, "the retry waited for the 30 s fallback interval"
    gap = attempts[1] - attempts[0]
    assert 0.4 <= gap < 2.0
    assert (await state(container, row_id)).processed_on is not None
    assert loop.cycles <= 6  # woke for the retry, no busy loop meanwhile


async def run_loop_until(loop: Processor, cycles: int, timeout: float = 20.0) -> None:
    """Run the loop until it has turned ``cycles`` times (a count, not a time window: on a loaded
    machine or behind a slow first connection, a fixed window once saw no cycle at all)."""
    task = asyncio.create_task(loop.run())
    try:
        await eventually(lambda: loop.cycles >= cycles, timeout)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task  # let it return its connection before the test ends


async def test_idle_polls_write_no_log_lines(
    container: OutboxContainer, caplog: pytest.LogCaptureFixture
) -> None:
    """A quiet service polls every interval forever: those polls must not fill the logs (or the
    traces, see test_tracing), not even at DEBUG; only a cycle with work says anything."""
    source = outbox_source(container, ScriptedDeliverer())
    loop = Processor(source, wake=asyncio.Event(), interval_seconds=0.05, clock=container.clock())
    with caplog.at_level(logging.DEBUG, logger=Processor.__module__.partition(".")[0]):
        await run_loop_until(loop, cycles=3)
    assert [r.getMessage() for r in caplog.records] == []


async def test_a_batch_that_fails_in_full_does_not_re_poll(container: OutboxContainer) -> None:
    """Five eligible rows, batches of two, every delivery failing: one cycle, then the loop
    waits (a minute here) instead of sweeping on and charging every row a retry."""
    ids = await insert_rows(container, [row("kit.a.v1", container.clock()()) for _ in range(5)])
    source = outbox_source(container, ScriptedDeliverer(fail), batch_size=2, retry_backoff_base_seconds=60)
    loop = Processor(source, wake=asyncio.Event(), interval_seconds=60, clock=container.clock())
    task = asyncio.create_task(loop.run())
    try:
        await eventually(lambda: loop.cycles >= 1, timeout=30)  # slow on a loaded machine
        await asyncio.sleep(1.0)  # a loop that swept on would have run again by now
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert loop.cycles == 1
    charged = [(await state(container, row_id)).retry_count for row_id in ids]
    assert sorted(charged) == [0, 0, 0, 1, 1]


async def test_a_cycle_that_delivered_re_polls_at_once(container: OutboxContainer) -> None:
    """A full batch, and a delivered keyed row whose key-mates wait, both re-poll without waiting
    for the fallback interval (a minute here): one key of five rows and three keyless rows
    drain in a few quick cycles."""
    now = container.clock()()
    ids = await insert_rows(
        container,
        [row("kit.a.v1", now, key="k") for _ in range(5)] + [row("kit.a.v1", now) for _ in range(3)],
    )
    deliverer = ScriptedDeliverer()
    source = outbox_source(container, deliverer, batch_size=2)
    loop = Processor(source, wake=asyncio.Event(), interval_seconds=60, clock=container.clock())
    task = asyncio.create_task(loop.run())
    try:
        for _ in range(300):
            if len(deliverer.delivered) == len(ids):
                break
            await asyncio.sleep(0.05)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert sorted(r.id for r in deliverer.delivered) == sorted(ids)
    keyed = [r.seq for r in deliverer.delivered if r.ordering_key == "k"]
    assert keyed == sorted(keyed)


async def test_a_local_event_without_a_handler_is_stamped_with_one_warning(
    container: OutboxContainer, caplog: pytest.LogCaptureFixture
) -> None:
    kit = await install_kit(container)
    clock = FakeClock()
    payload = container.registry().dump(Created(aggregate_id="c", tenant_id="acme"))
    ids = await insert_rows(
        container, [row("kit.created.v1", clock.now, kind="domain", payload=payload) for _ in range(2)]
    )
    with caplog.at_level(logging.WARNING):
        await outbox_source(container, container.outbox_deliverer(), clock).run_cycle()
    assert [(await state(container, i)).processed_on is not None for i in ids] == [True, True]
    assert caplog.text.count("no handler for it is registered on this host") == 1
    del kit


async def test_a_local_event_declared_record_only_is_stamped_quietly(
    container: OutboxContainer, caplog: pytest.LogCaptureFixture
) -> None:
    """An event kept as a record, with no handler by design, says so once at registration and
    the processor stamps its rows without a warning; a handler for it is a registration error."""
    kit = await install_kit(container)
    container.handlers().record_only(Created)
    with pytest.raises(HandlerRegistryError, match="record-only"):
        container.handlers().on_domain_event(Created, lambda _event, _uow: asyncio.sleep(0))
    clock = FakeClock()
    payload = container.registry().dump(Created(aggregate_id="c", tenant_id="acme"))
    ids = await insert_rows(container, [row("kit.created.v1", clock.now, kind="domain", payload=payload)])
    with caplog.at_level(logging.WARNING):
        await outbox_source(container, container.outbox_deliverer(), clock).run_cycle()
    assert (await state(container, ids[0])).processed_on is not None
    assert "no handler" not in caplog.text
    del kit


async def test_the_processor_delivers_local_events_under_the_rows_context(container: OutboxContainer) -> None:
    kit = await install_kit(container)
    seen: list[tuple[str | None, str | None, str | None]] = []

    async def who(event: Created, uow: Any) -> None:
        from outbox_kit.application.context import (
            current_context,
        )

        context = current_context()
        seen.append((context.tenant_id, context.user_id, context.authentication_type))

    container.dispatcher().dispatch = _no_dispatch  # type: ignore[method-assign]
    kit.on(Created, who)
    for tenant in ("acme", "globex"):
        with acting_as(tenant=tenant, user=f"user-of-{tenant}"):
            async with container.units_of_work()() as uow:
                uow.repository(Counters).add(Counter.create(tenant))
                await uow.commit()
    clock = FakeClock(container.clock()() + timedelta(seconds=1000))  # past lease and delay
    with acting_as(tenant="intruder", user="nobody"):
        await outbox_source(container, container.outbox_deliverer(), clock).run_cycle()
    assert seen == [("acme", "user-of-acme", "outbox"), ("globex", "user-of-globex", "outbox")]
    assert all(r.processed_on is not None for r in await all_rows(container))


async def _no_dispatch(*_args: Any, **_kwargs: Any) -> None:
    return None


@pytest.mark.postgres
async def test_a_bookkeeping_transaction_left_idle_is_ended_and_frees_its_rows(postgres_url: str) -> None:
    """A process frozen inside a claim or stamp transaction (a paused VM) holds its rows' locks;
    the server ends such a transaction after ``DATABASE__BOOKKEEPING_IDLE_TIMEOUT_SECONDS``, so
    another worker can take the rows once their lease is over."""
    frozen = kit_container(make_settings(postgres_url, database={"bookkeeping_idle_timeout_seconds": 0.5}))
    other = kit_container(make_settings(postgres_url))
    try:
        (row_id,) = await insert_rows(frozen, [row("kit.a.v1", FakeClock().now)])
        locked = sa.select(OUTBOX_TABLE.c.id).where(OUTBOX_TABLE.c.id == row_id).with_for_update(nowait=True)

        async def frozen_inside_a_transaction() -> None:
            async with frozen.database().bookkeeping() as connection:
                await connection.execute(locked)
                await asyncio.sleep(1.5)  # a paused process

        freezing = asyncio.create_task(frozen_inside_a_transaction())
        await asyncio.sleep(1.0)  # past the 0.5 s timeout, still frozen
        async with other.database().bookkeeping() as free:
            assert (await free.execute(locked)).scalar_one() == row_id  # NOWAIT: the lock is gone
        with pytest.raises(DBAPIError):  # its session was ended under it
            await freezing
    finally:
        for container in (frozen, other):
            await container.database().dispose()
