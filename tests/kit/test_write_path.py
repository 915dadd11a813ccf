"""The write side of the outbox (issue: write path), on SQLite and PostgreSQL.

Every line of the unit of work's contract has a test here that fails if the behaviour breaks.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import uuid
from collections.abc import Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from outbox_kit.domain import (
    ConcurrencyError,
    DomainError,
    NotFoundError,
)
from outbox_kit.persistence.database import (
    Database,
    DatabaseSettings,
)
from outbox_kit.persistence.save_guard import HandlerMustNotSaveError
from outbox_kit.persistence.tables import (
    COMMAND_TABLE,
    OUTBOX_TABLE,
    InternalCommandRow,
    OutboxMessage,
)
from outbox_kit.persistence.unit_of_work import SqlUnitOfWork
from outbox_kit.persistence.writer import RelayWriter
from outbox_kit.processor.claim import (
    Claimer,
)
from outbox_kit.runtime.container import OutboxContainer
from outbox_kit.testing.fixtures import (
    ContainerFactory,
    acting_as,
    eventually,
    fetch,
    kit_container,
    make_settings,
)
from outbox_kit.testing.harness import (
    COUNTERS,
    Counter,
    CounterChangedV1,
    Counters,
    Created,
    Incremented,
    Kit,
    RecordEffect,
    install_kit,
    record_effect,
)
from sqlalchemy.exc import OperationalError
from sqlmodel import select

pytestmark = pytest.mark.integration


@pytest.fixture
async def kit(container: OutboxContainer) -> Kit:
    return await install_kit(container)


async def outbox(container: OutboxContainer) -> list[Any]:
    return await fetch(container, sa.select(OUTBOX_TABLE).order_by(OUTBOX_TABLE.c.seq))


async def place(kit: Kit, *, increments: int = 0) -> Counter:
    with acting_as():
        async with kit.container.units_of_work()() as uow:
            counter = Counter.create("acme")
            for _ in range(increments):
                counter.increment()
            uow.repository(Counters).add(counter)
            await uow.commit()
    return counter


async def test_commit_writes_one_row_per_event_with_stable_names(kit: Kit) -> None:
    await place(kit, increments=2)
    rows = await outbox(kit.container)
    assert [r.event_name for r in rows] == ["kit.created.v1", "kit.incremented.v1", "kit.incremented.v1"]
    assert [r.kind for r in rows] == ["domain"] * 3
    assert len({r.seq for r in rows}) == 3
    assert all(r.ordering_key == rows[0].ordering_key for r in rows)


async def test_local_events_are_not_ordered_behind_the_aggregates_integration_events(kit: Kit) -> None:
    """Keys are per kind: an unpublished integration event of an aggregate (say, the broker is
    down) does not hold back the in-process dispatch of that aggregate's next domain event."""
    kit.on(Created, kit.recording("created"))
    kit.on(Incremented, kit.recording("incremented"))
    with acting_as():
        async with kit.container.units_of_work()() as uow:
            counter = Counter.create("acme")
            uow.repository(Counters).add(counter)
            uow.enqueue(CounterChangedV1(aggregate_id=counter.id, counter_id=counter.id, value=0))
            await uow.commit()
        async with kit.container.units_of_work()() as uow:
            (await uow.repository(Counters).get(counter.id)).increment()
            await uow.commit()
    assert [label for label, _ in kit.seen] == ["created", "incremented"]
    rows = {r.event_name: r for r in await outbox(kit.container)}
    assert rows["kit.counter-changed.v1"].processed_on is None  # still waiting for its publish
    assert rows["kit.incremented.v1"].processed_on is not None
    assert rows["kit.incremented.v1"].ordering_key == f"domain:{counter.id}"
    assert rows["kit.counter-changed.v1"].ordering_key == f"integration:{counter.id}"


async def fail_mid_transaction(kit: Kit) -> None:
    async with kit.container.units_of_work()() as uow:
        uow.repository(Counters).add(Counter.create("acme"))
        uow.enqueue(CounterChangedV1(counter_id="c", value=1))
        uow.schedule(RecordEffect(label="never"))
        msg = "business failure"
        raise RuntimeError(msg)


async def test_rollback_leaves_nothing_behind(kit: Kit) -> None:
    with acting_as(), pytest.raises(RuntimeError, match="business failure"):
        await fail_mid_transaction(kit)
    with acting_as():
        async with kit.container.units_of_work()() as uow:
            uow.repository(Counters).add(Counter.create("acme"))
            await uow.rollback()
    assert await outbox(kit.container) == []
    assert await fetch(kit.container, sa.select(COUNTERS)) == []
    assert await fetch(kit.container, select(InternalCommandRow)) == []


class FailOnceAfterInserting(RelayWriter):
    """Writes the rows, then fails like a serialization failure (the transaction rolls back)."""

    failures = 0

    async def write(self, session: Any, capture: Any) -> Any:
        written = await super().write(session, capture)
        if self.failures == 0:
            self.failures += 1
            raise OperationalError("COMMIT", {}, Exception("database is locked"))
        return written


async def test_a_retried_operation_writes_exactly_one_row_per_event(kit: Kit) -> None:
    units = kit.container.units_of_work()
    failing = FailOnceAfterInserting.__new__(FailOnceAfterInserting)
    failing.__dict__.update(units.writer.__dict__)
    units.writer = failing
    counter = Counter.create("acme")  # raised outside the operation: pending across attempts
    counter.increment()
    attempts = 0

    async def operation(uow: SqlUnitOfWork) -> None:
        nonlocal attempts
        attempts += 1
        uow.repository(Counters).add(counter)

    with acting_as():
        await units().run(operation)
    assert attempts == 2
    rows = await outbox(kit.container)
    assert [r.event_name for r in rows] == ["kit.created.v1", "kit.incremented.v1"]
    assert counter.pending_events == ()
    assert counter.version == 1


async def test_commit_removes_exactly_the_captured_events(kit: Kit) -> None:
    units = kit.container.units_of_work()
    counter = Counter.create("acme")

    class RaisesDuringCommit(RelayWriter):
        async def write(self, session: Any, capture: Any) -> Any:
            counter.increment()  # a handler raising on the same aggregate mid-save
            return await super().write(session, capture)

    writer = RaisesDuringCommit.__new__(RaisesDuringCommit)
    writer.__dict__.update(units.writer.__dict__)
    units.writer = writer
    with acting_as():
        async with units() as uow:
            uow.repository(Counters).add(counter)
            await uow.commit()
    assert [type(e) for e in counter.pending_events] == [Incremented]
    assert [r.event_name for r in await outbox(kit.container)] == ["kit.created.v1"]


async def test_context_is_captured_on_every_row_and_roles_are_capped(kit: Kit) -> None:
    roles = tuple(f"role-number-{i:03d}" for i in range(60))
    with acting_as(tenant="globex", user="bob", roles=roles, correlation_id="corr-77"):
        async with kit.container.units_of_work()() as uow:
            uow.repository(Counters).add(Counter.create("globex"))
            uow.enqueue(CounterChangedV1(counter_id="c-1", value=1))
            uow.schedule(RecordEffect(label="later"))
            await uow.commit()
    rows = [*await outbox(kit.container), *await fetch(kit.container, select(InternalCommandRow))]
    assert len(rows) == 3
    for row in rows:
        assert (row.tenant_id, row.user_id, row.correlation_id) == ("globex", "bob", "corr-77")
        assert row.trace_context.startswith("00-" + "a" * 32)
        assert 0 < len(row.user_roles) <= 512
        assert row.user_roles.split(",") == list(roles[: len(row.user_roles.split(","))])


async def test_local_rows_are_leased_at_insert_and_integration_rows_are_not(kit: Kit) -> None:
    observed: list[Any] = []

    async def peek(event: Created, uow: SqlUnitOfWork) -> None:
        observed.extend(await outbox(kit.container))  # another session, while dispatching

    kit.on(Created, peek)
    with acting_as():
        async with kit.container.units_of_work()() as uow:
            uow.repository(Counters).add(Counter.create("acme"))
            uow.enqueue(CounterChangedV1(counter_id="c-1", value=1))
            now = uow.now
            await uow.commit()
    by_kind = {row.kind: row for row in observed}
    local, integration = by_kind["domain"], by_kind["integration"]
    lease = kit.container.settings().outbox.lease_seconds
    assert local.lock_token is not None
    assert local.locked_until >= now + timedelta(seconds=lease - 5)
    assert local.locked_by == "test-processor"
    assert integration.lock_token is None
    assert integration.locked_until is None
    assert integration.available_on <= local.available_on  # no processing delay for integration


async def test_handler_effects_and_processed_stamp_commit_together(kit: Kit) -> None:
    kit.on(Created, kit.recording("projector"))
    await place(kit)
    (row,) = await outbox(kit.container)
    assert row.processed_on is not None
    assert row.lock_token is None
    assert await kit.effects() == ["projector:kit.created.v1"]


async def test_a_failed_dispatch_releases_the_lease_and_keeps_no_effect(kit: Kit) -> None:
    async def fails_after_an_effect(event: Created, uow: SqlUnitOfWork) -> None:
        await kit.recording("partial")(event, uow)
        msg = "handler exploded"
        raise RuntimeError(msg)

    kit.on(Created, fails_after_an_effect)
    await place(kit)
    (row,) = await outbox(kit.container)
    assert row.processed_on is None
    assert (row.lock_token, row.locked_until, row.locked_by) == (None, None, None)
    assert "handler exploded" in row.last_error
    assert row.retry_count == 0  # an in-process attempt is not one of the processor's retries
    assert await kit.effects() == []


async def test_a_failed_release_is_logged_and_the_row_waits_out_its_lease(
    kit: Kit, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The release after a failed dispatch is best effort: if it fails too, the error is logged,
    the commit still stands, and the row stays leased until the processor may take it."""

    async def release_fails(*_args: object, **_kwargs: object) -> set[uuid.UUID]:
        msg = "connection reset while releasing"
        raise ConnectionResetError(msg)

    async def fails(event: Created, uow: SqlUnitOfWork) -> None:
        msg = "handler exploded"
        raise RuntimeError(msg)

    monkeypatch.setattr(kit.container.dispatcher()._leases.store, "release", release_fails)
    kit.on(Created, fails)
    lease = kit.container.settings().outbox.lease_seconds
    with caplog.at_level(logging.ERROR):
        counter = await place(kit)
    (row,) = await outbox(kit.container)
    assert row.ordering_key == f"domain:{counter.id}"  # the business write committed
    assert row.lock_token is not None
    assert row.processed_on is None
    assert row.locked_until > row.occurred_on + timedelta(seconds=lease - 60)
    assert "could not release the lease of 1 outbox row(s)" in caplog.text


async def test_a_lost_lease_rolls_the_handler_effects_back(kit: Kit) -> None:
    thief = uuid.uuid4()

    async def loses_its_lease(event: Created, uow: SqlUnitOfWork) -> None:
        # Another replica claims the row while the handler runs (before the handler writes:
        # SQLite has a single writer, so that is the only moment it can happen there).
        async def other_replica() -> None:
            async with kit.container.database().session() as other:
                await other.exec(sa.update(OUTBOX_TABLE).values(lock_token=thief))  # type: ignore[call-overload]
                await other.commit()

        # A fresh context: that commit belongs to another process, not to this handler.
        await asyncio.create_task(other_replica(), context=contextvars.Context())
        await kit.recording("doomed")(event, uow)

    kit.on(Created, loses_its_lease)
    await place(kit)
    (row,) = await outbox(kit.container)
    assert row.lock_token == thief
    assert row.processed_on is None
    assert await kit.effects() == []


async def test_a_crash_before_dispatch_leaves_rows_claimable_after_the_lease(kit: Kit) -> None:
    kit.on(Created, kit.recording("projector"))
    dispatcher = kit.container.dispatcher()

    async def crash(*_args: Any, **_kwargs: Any) -> None:
        return None  # the process "dies" between commit and dispatch

    dispatcher.dispatch = crash  # type: ignore[method-assign]
    await place(kit)
    claimer = Claimer(OUTBOX_TABLE, "event_name", batch=10, window=80)
    (row,) = await outbox(kit.container)
    lease = timedelta(seconds=kit.container.settings().outbox.lease_seconds)
    async with kit.container.database().bookkeeping() as connection:
        early = await claimer.claim(
            connection,
            now=row.occurred_on + lease / 2,
            lease_until=row.occurred_on + lease,
            token=uuid.uuid4(),
            locked_by="p2",
        )
        late = await claimer.claim(
            connection,
            now=row.locked_until + timedelta(seconds=1),
            lease_until=row.locked_until + lease,
            token=uuid.uuid4(),
            locked_by="p2",
        )
    assert early == []
    assert [r.id for r in late] == [row.id]


@pytest.mark.postgres
async def test_a_real_postgresql_deadlock_is_retried_with_one_row_per_event(postgres_url: str) -> None:
    """Two operations lock two rows in opposite orders: PostgreSQL kills one (40P01), ``run``
    re-runs it on a fresh session, and each operation's event is written exactly once."""
    container = kit_container(make_settings(postgres_url))
    try:
        kit = await install_kit(container)
        first, second = await place(kit), await place(kit)
        both_hold_a_lock = asyncio.Barrier(2)
        attempts: list[str] = []

        def crossing(mine: Counter, theirs: Counter) -> Callable[[SqlUnitOfWork], Awaitable[None]]:
            async def operation(uow: SqlUnitOfWork) -> None:
                attempts.append(mine.id)
                await lock_row(uow, mine.id)
                if attempts.count(mine.id) == 1:
                    await asyncio.wait_for(both_hold_a_lock.wait(), 10)
                await lock_row(uow, theirs.id)
                (await uow.repository(Counters).get(mine.id)).increment()

            return operation

        units = container.units_of_work()
        with acting_as():
            await asyncio.gather(units().run(crossing(first, second)), units().run(crossing(second, first)))
        assert len(attempts) == 3, "one of the two operations must have been re-run"
        increments = [r for r in await outbox(container) if r.event_name == "kit.incremented.v1"]
        assert sorted(r.ordering_key for r in increments) == sorted(f"domain:{c.id}" for c in (first, second))
        values = await fetch(container, sa.select(COUNTERS.c.value))
        assert sorted(v for (v,) in values) == [1, 1]
    finally:
        await container.database().dispose()


async def lock_row(uow: SqlUnitOfWork, counter_id: str) -> None:
    statement = sa.update(COUNTERS).where(COUNTERS.c.id == counter_id).values(value=COUNTERS.c.value)
    await uow.session.exec(statement)  # type: ignore[call-overload]


async def test_a_commit_wakes_the_processor_long_before_the_fallback_interval(
    make_container: ContainerFactory,
) -> None:
    """The fallback poll is a minute away: only the wake signal (and NOTIFY on PostgreSQL) set by
    the commit can deliver the integration event within the test's patience."""
    container = make_container(outbox={"polling_interval_seconds": 60})
    await install_kit(container)
    delivered: list[int] = []

    async def consumer(event: CounterChangedV1, uow: SqlUnitOfWork) -> None:
        delivered.append(event.value)

    container.handlers().consume("kit.wake-observer", CounterChangedV1, consumer)
    registry = container.metrics().registry
    await container.bus().start()
    await container.worker().start()
    try:
        heartbeat = {"source": "outbox"}
        await eventually(lambda: registry.get_sample_value(HEARTBEAT, heartbeat) is not None)
        with acting_as():
            async with container.units_of_work()() as uow:
                uow.enqueue(CounterChangedV1(counter_id="c", value=7))
                await uow.commit()
        await eventually(lambda: delivered == [7])
    finally:
        await container.worker().stop()
        await container.bus().stop()


HEARTBEAT = "outbox_processor_heartbeat_timestamp_seconds"


async def test_a_savepoint_release_does_not_dispatch(kit: Kit) -> None:
    kit.on(Created, kit.recording("projector"))
    with acting_as():
        async with kit.container.units_of_work()() as uow:
            async with uow.savepoint():
                uow.repository(Counters).add(Counter.create("acme"))
            assert kit.seen == []
            await uow.commit()
    assert [label for label, _ in kit.seen] == ["projector"]


async def test_a_failed_savepoint_rolls_back_its_share_of_the_unit_of_work(kit: Kit) -> None:
    """The database rolls back to the savepoint, and so does the unit of work: state, events,
    newly tracked aggregates, enqueued events and scheduled commands of the failed block."""
    kept = await place(kit)
    with acting_as():
        async with kit.container.units_of_work()() as uow:
            counter = await uow.repository(Counters).get(kept.id)
            counter.increment(2)
            uow.enqueue(CounterChangedV1(aggregate_id=counter.id, counter_id=counter.id, value=2))

            async def fail_inside_a_savepoint() -> None:
                async with uow.savepoint():
                    counter.increment(40)
                    uow.repository(Counters).add(Counter.create("acme", "born-in-the-savepoint"))
                    uow.enqueue(CounterChangedV1(aggregate_id=counter.id, counter_id=counter.id, value=42))
                    uow.schedule(RecordEffect(label="from the failed block"))
                    await record_effect(uow, "written in the failed block")
                    raise RuntimeError("give up")

            with pytest.raises(RuntimeError, match="give up"):
                await fail_inside_a_savepoint()
            assert counter.value == 2
            await uow.commit()
    rows = await fetch(kit.container, sa.select(COUNTERS.c.id, COUNTERS.c.value).order_by(COUNTERS.c.id))
    assert [tuple(r) for r in rows] == [(kept.id, 2)]
    names = [(r.event_name, r.payload.get("value")) for r in await outbox(kit.container)]
    assert names == [("kit.created.v1", None), ("kit.incremented.v1", None), ("kit.counter-changed.v1", 2)]
    assert await fetch(kit.container, sa.select(InternalCommandRow)) == []
    assert await kit.effects() == []


async def test_a_handler_may_use_a_savepoint(kit: Kit) -> None:
    """A savepoint commits nothing, so the run-time guard lets a handler use one."""

    class OptionalStepFailedError(Exception):
        pass

    async def careful(event: Any, uow: SqlUnitOfWork) -> None:
        with contextlib.suppress(OptionalStepFailedError):
            async with uow.savepoint():
                await record_effect(uow, "tried")
                raise OptionalStepFailedError
        async with uow.savepoint():  # released: SAVEPOINT ... RELEASE, no commit
            await record_effect(uow, "kept")

    kit.on(Created, careful)
    await place(kit)
    assert await kit.effects() == ["kept"]
    assert all(r.processed_on is not None for r in await outbox(kit.container))


async def test_a_cascade_past_the_depth_bound_is_dead_lettered(make_container: ContainerFactory) -> None:
    """A handler loop (each increment raises the next) stops at OUTBOX__MAX_CASCADE_DEPTH: the
    rows past it are dead-lettered with a reason, never handed on to restart the count."""
    kit = await install_kit(make_container(outbox={"max_cascade_depth": 3}))

    async def increment_again(event: Incremented, uow: SqlUnitOfWork) -> None:
        counter = await uow.repository(Counters).get(event.aggregate_id)
        counter.increment()

    kit.on(Created, kit.recording("created"))
    kit.on(Incremented, increment_again)
    counter = await place(kit, increments=1)
    rows = await outbox(kit.container)
    increments = [r for r in rows if r.event_name == "kit.incremented.v1"]
    assert [r.processed_on is not None for r in increments] == [True, True, True, False]
    assert increments[-1].dead_letter_reason == "cascade_depth_exceeded"
    assert "OUTBOX__MAX_CASCADE_DEPTH" in increments[-1].last_error
    values = await fetch(kit.container, sa.select(COUNTERS.c.value).where(COUNTERS.c.id == counter.id))
    assert values == [(4,)]
    metric = kit.container.metrics().registry.get_sample_value(
        "outbox_dead_letters_total", {"source": "outbox", "reason": "cascade_depth_exceeded"}
    )
    assert metric == 1.0


async def test_a_cascade_is_delivered_after_the_rest_of_its_commit_in_key_order(kit: Kit) -> None:
    """In-process delivery goes a generation at a time: every row of a commit, then the rows
    their handlers' commits raised. An event a handler raises on its own aggregate (the same
    key) therefore comes after the commit's later row of that key and is delivered here too;
    depth first, it found that row still pending and was left to the processor."""

    async def increment_on_creation(event: Created, uow: SqlUnitOfWork) -> None:
        kit.seen.append(("created", event))
        counter = await uow.repository(Counters).get(event.aggregate_id)
        counter.increment()

    kit.on(Created, increment_on_creation)
    kit.on(Incremented, kit.recording("incremented"))
    await place(kit, increments=1)
    rows = await outbox(kit.container)
    assert [r.event_name for r in rows] == ["kit.created.v1", "kit.incremented.v1", "kit.incremented.v1"]
    assert len({r.ordering_key for r in rows}) == 1
    assert [r.processed_on is not None for r in rows] == [True, True, True], "one was left to the processor"
    assert [label for label, _ in kit.seen] == ["created", "incremented", "incremented"]
    delivered = [str(event.event_id) for _, event in kit.seen]
    assert delivered == [row.payload["event_id"] for row in rows], "not in seq order"


async def test_the_longest_ordering_key_commits_and_a_longer_one_is_refused_before(kit: Kit) -> None:
    """The same answer on SQLite and PostgreSQL: a key at the limit is stored (with its kind in
    front) and delivered; one character more is refused when the event is raised, naming the
    limit, and nothing is written."""
    kit.on(Created, kit.recording("created"))
    longest = "c" * 128  # the documented limit, spelled out: it is part of the contract
    with acting_as():
        async with kit.container.units_of_work()() as uow:
            uow.repository(Counters).add(Counter.create("acme", longest))
            uow.enqueue(CounterChangedV1(aggregate_id=longest, counter_id=longest, value=0))
            await uow.commit()
        with pytest.raises(DomainError, match="at most 128 characters"):
            Counter.create("acme", "c" * 195)
    keys = sorted(r.ordering_key for r in await outbox(kit.container))
    assert keys == [f"domain:{longest}", f"integration:{longest}"]
    assert [label for label, _ in kit.seen] == ["created"]


async def test_a_stale_aggregate_version_is_refused(kit: Kit) -> None:
    counter = await place(kit)
    units = kit.container.units_of_work()
    with acting_as():
        async with units() as first, units() as second:
            mine = await first.repository(Counters).get(counter.id)
            theirs = await second.repository(Counters).get(counter.id)
            mine.increment()
            await first.commit()
            theirs.increment(5)
            with pytest.raises(ConcurrencyError, match="changed by someone else"):
                await second.commit()
    rows = await fetch(kit.container, sa.select(COUNTERS.c.value, COUNTERS.c.version))
    assert [tuple(r) for r in rows] == [(1, 2)]


async def test_another_tenants_aggregate_is_not_found(kit: Kit) -> None:
    counter = await place(kit)
    with acting_as(tenant="globex"):
        async with kit.container.units_of_work()() as uow:
            with pytest.raises(NotFoundError, match="was not found"):
                await uow.repository(Counters).get(counter.id)


async def test_integration_events_and_commands_are_written_unleased(kit: Kit) -> None:
    with acting_as():
        async with kit.container.units_of_work()() as uow:
            uow.enqueue(CounterChangedV1(counter_id="c-1", value=3, aggregate_id="c-1"))
            due = uow.now + timedelta(minutes=5)
            uow.schedule(RecordEffect(label="later"), due_at=due)
            await uow.commit()
    (event,) = await outbox(kit.container)
    assert (event.event_name, event.kind, event.ordering_key) == (
        "kit.counter-changed.v1",
        "integration",
        "integration:c-1",
    )
    (command,) = await fetch(kit.container, select(InternalCommandRow))
    assert command.command_name == "kit.record-effect.v1"
    assert command.available_on == due
    assert command.lock_token is None


async def test_outbox_off_dispatches_directly_without_rows(make_container: ContainerFactory) -> None:
    container = make_container(message_bus={"enable_outbox": False, "enable_inbox": False})
    kit = await install_kit(container)
    kit.on(Created, kit.recording("direct"))
    await place(kit)
    assert await fetch(container, select(OutboxMessage)) == []
    assert await kit.effects() == ["direct:kit.created.v1"]


async def test_outbox_off_publishes_integration_events_directly(make_container: ContainerFactory) -> None:
    container = make_container(message_bus={"enable_outbox": False, "enable_inbox": False})
    kit = await install_kit(container)
    received: list[tuple[int, str | None]] = []

    async def consume(event: CounterChangedV1, uow: SqlUnitOfWork) -> None:
        from outbox_kit.application.context import (
            current_context,
        )

        received.append((event.value, current_context().tenant_id))

    container.handlers().consume("kit.direct", CounterChangedV1, consume)
    with acting_as(tenant="globex"):
        async with container.units_of_work()() as uow:
            uow.enqueue(CounterChangedV1(counter_id="c", value=4))
            await uow.commit()
    assert received == [(4, "globex")]
    assert await fetch(container, select(OutboxMessage)) == []
    del kit


async def test_a_handler_cannot_commit_the_session_underneath_either(kit: Kit) -> None:
    refused: list[BaseException] = []

    async def commits_the_session(event: Created, uow: SqlUnitOfWork) -> None:
        await kit.recording("sneaky")(event, uow)
        try:
            await uow.session.commit()
        except HandlerMustNotSaveError as error:
            refused.append(error)
            raise

    commits_the_session.__qualname__ = "commits_the_session"
    kit.on(Created, commits_the_session)
    await place(kit)
    (error,) = refused
    assert "commits_the_session" in str(error)
    assert await kit.effects() == []  # nothing the handler staged was saved
    (row,) = await outbox(kit.container)
    assert row.processed_on is None
    assert "HandlerMustNotSaveError" in row.last_error


async def test_sqlite_runs_in_wal_mode_with_the_configured_busy_timeout(tmp_path: Path) -> None:
    """WAL lets the API and the worker read while the other writes; the busy timeout makes a
    writer wait for the lock instead of failing at once with "database is locked"."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'embedded.db'}"
    database = Database(DatabaseSettings(url=url, sqlite_busy_timeout_ms=4321))
    try:
        async with database.engine.connect() as connection:
            assert (await connection.execute(sa.text("PRAGMA journal_mode"))).scalar() == "wal"
            assert (await connection.execute(sa.text("PRAGMA busy_timeout"))).scalar() == 4321
    finally:
        await database.dispose()


@pytest.mark.postgres
async def test_a_pooled_connection_the_server_dropped_while_idle_is_replaced_before_use(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restart or a failover between two requests leaves a dead connection in the pool: once
    it has sat idle past the threshold it is pinged before use, found dead and replaced, and the
    unit of work never sees it. One used within the threshold is not pinged (no round trip per
    unit of work): it is the same connection, and its server process was never asked."""
    import asyncpg
    from outbox_kit.persistence import database as database_module
    from outbox_kit.testing.fixtures import plain_dsn

    monkeypatch.setattr(database_module, "PING_AFTER_IDLE_SECONDS", 0.3)
    container = kit_container(make_settings(postgres_url))
    engine = container.database().engine
    pid = sa.text("SELECT pg_backend_pid()")
    try:
        async with engine.connect() as connection:
            first = (await connection.execute(pid)).scalar_one()
        async with engine.connect() as connection:  # at once: the same connection, not pinged
            assert (await connection.execute(pid)).scalar_one() == first
        admin = await asyncpg.connect(plain_dsn(postgres_url))
        try:
            assert await admin.fetchval("SELECT pg_terminate_backend($1)", first)
        finally:
            await admin.close()
        await asyncio.sleep(0.5)  # idle past the threshold
        async with container.units_of_work()() as uow:
            replaced = (await uow.session.exec(pid)).scalar_one()  # type: ignore[call-overload]
        assert replaced != first
    finally:
        await container.database().dispose()


# -- PostgreSQL: a commit's rows in one statement ------------------------------------------------


@pytest.mark.postgres
async def test_a_commits_rows_of_one_table_are_one_statement_in_the_order_raised(postgres_url: str) -> None:
    """Two domain events of one aggregate, an integration event and a command: one statement
    for the outbox's three rows (their keys' locks and the wake in it) and one for the command,
    the rows in the order they were raised, with ascending seq and the request's context."""
    container = kit_container(make_settings(postgres_url))
    seen: list[str] = []

    def record(*args: Any) -> None:
        seen.append(str(args[2]))

    try:
        await install_kit(container)
        engine = container.database().engine.sync_engine
        sa.event.listen(engine, "before_cursor_execute", record)
        with acting_as():
            async with container.units_of_work()() as uow:
                counter = Counter.create("acme", "raised-in-order")
                counter.increment()
                uow.repository(Counters).add(counter)
                uow.enqueue(CounterChangedV1(counter_id=counter.id, value=1, aggregate_id=counter.id))
                uow.schedule(RecordEffect(label="later"), due_at=uow.now + timedelta(minutes=5))
                await uow.commit()
        sa.event.remove(engine, "before_cursor_execute", record)
        relay = [s for s in seen if "outbox_messages" in s or "internal_commands" in s]
        tables = ("outbox_messages", "internal_commands")
        assert len(relay) == 2
        assert [name for s in relay for name in tables if f"INTO {name} " in s] == list(tables)
        assert not [s for s in seen if "pg_advisory_xact_lock" in s and "INSERT" not in s]
        rows = await outbox(container)
        assert [r.event_name for r in rows] == [
            "kit.created.v1",
            "kit.incremented.v1",
            "kit.counter-changed.v1",
        ]
        assert [r.seq for r in rows] == sorted(r.seq for r in rows)
        assert {(r.tenant_id, r.user_id, r.correlation_id) for r in rows} == {("acme", "alice", "corr-1")}
        assert all(r.occurred_on.tzinfo is not None for r in rows)
        assert rows[-1].payload["counter_id"] == "raised-in-order"
        (command,) = await fetch(container, sa.select(COMMAND_TABLE))
        assert (command.command_name, command.payload["label"]) == ("kit.record-effect.v1", "later")
    finally:
        await container.database().dispose()


@pytest.mark.postgres
async def test_a_writer_of_the_same_key_waits_for_the_open_commit_and_comes_after_it(
    postgres_url: str,
) -> None:
    """The insert takes the key's advisory lock before any row gets its seq: a second writer of
    the key waits until the first commits, so seq order is commit order within a key (a row
    that took its seq first but committed second would be relayed after a later one). A writer
    of another key does not wait."""
    container = kit_container(make_settings(postgres_url))

    def changed(key: str, value: int) -> CounterChangedV1:
        return CounterChangedV1(counter_id=key, value=value, aggregate_id=key)

    async def commit_one(event: CounterChangedV1) -> None:
        async with container.units_of_work()() as uow:
            await uow.session.exec(sa.text("SELECT 1"))  # type: ignore[call-overload]
            uow.enqueue(event)
            await uow.commit()

    async def lock_waiters() -> int:
        # This test's database only: the server is shared with the tests running beside it.
        waiting = (
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        )
        return int((await fetch(container, sa.text(waiting)))[0][0])

    try:
        await install_kit(container)
        with acting_as():
            async with container.units_of_work()() as first:
                await first.session.exec(sa.text("SELECT 1"))  # type: ignore[call-overload]
                first.enqueue(changed("k", 1))
                staged = await first.stage()  # the row is in and the key's lock held: no COMMIT yet
                await asyncio.wait_for(commit_one(changed("other", 2)), 10)
                second = asyncio.create_task(commit_one(changed("k", 3)))
                for _ in range(500):
                    if await lock_waiters() == 1:
                        break
                    await asyncio.sleep(0.02)
                assert await lock_waiters() == 1, "the second writer of the key must wait for its lock"
                assert not second.done()
                await first.session.commit()
                await first.committed_as(staged)
            await asyncio.wait_for(second, 10)
        rows = await outbox(container)
        assert [(r.ordering_key, r.payload["value"]) for r in rows] == [
            ("integration:k", 1),
            ("integration:other", 2),
            ("integration:k", 3),
        ]
    finally:
        await container.database().dispose()
