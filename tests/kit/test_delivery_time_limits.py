"""Every delivery has a time limit (``OUTBOX__DELIVERY_TIMEOUT_SECONDS``), and the lease is
renewed whenever what is left of it might not outlast one: a handler that never returns holds
only its own row (charged, then dead-lettered), and no replica ever starts a row another one is
still delivering. The consumer side's limit is in test_brokers.py."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter as Tally
from typing import Any

import pytest
import sqlalchemy as sa
from outbox_kit.persistence.tables import (
    COMMAND_TABLE,
    OUTBOX_TABLE,
)
from outbox_kit.persistence.unit_of_work import SqlUnitOfWork
from outbox_kit.processor.claim import ClaimedRow
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
    Counter,
    CounterChangedV1,
    Counters,
    Noted,
    RecordEffect,
    ScriptedDeliverer,
    insert_rows,
    install_kit,
    outbox_source,
    record_effect,
    row,
)
from outbox_kit.transports.bus import Delivered

pytestmark = pytest.mark.integration
HANG = "hang"
# A one-second limit; the lease leaves room for it and its margin, and a publish cannot be longer
# (nor, on the in-process transport, a consumer's handler run).
LIMITED = {"delivery_timeout_seconds": 1, "lease_seconds": 10, "processing_delay_seconds": 0}
PUBLISH = {"publish_timeout_seconds": 0.8, "handler_timeout_seconds": 0.5}


class HangsOnce:
    """A local handler that never returns for the note ``hang``; other notes record an effect."""

    def __init__(self) -> None:
        self.hung = 0

    async def __call__(self, event: Noted, uow: SqlUnitOfWork) -> None:
        if event.text == HANG:
            self.hung += 1
            await asyncio.Event().wait()  # never set: the handler never returns
        await record_effect(uow, f"noted:{event.text}")


async def note(container: OutboxContainer, *texts: str) -> None:
    with acting_as():
        async with container.units_of_work()() as uow:
            counter = Counter.create("acme")
            for text in texts:
                counter.note(text)
            uow.repository(Counters).add(counter)
            await uow.commit()


async def noted_rows(container: OutboxContainer) -> dict[str, Any]:
    rows = await fetch(container, sa.select(OUTBOX_TABLE).where(OUTBOX_TABLE.c.event_name == "kit.noted.v1"))
    return {r.payload["text"]: r for r in rows}


async def until(check: Any, timeout: float = 30.0) -> None:
    """Poll an async check until it holds (``eventually`` takes a plain one)."""
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "not reached in time"
        await asyncio.sleep(0.1)


async def test_a_local_handler_that_never_returns_holds_only_its_own_row(
    make_container: ContainerFactory, database_url: str
) -> None:
    """The processor (two replicas on PostgreSQL) keeps delivering unrelated rows while one
    handler hangs; the hung row is charged a retry per time limit and dead-lettered."""
    replicas = 2 if database_url.startswith("postgresql") else 1
    settings = {**LIMITED, "immediate_dispatch": False, "max_retries": 2, "retry_backoff_base_seconds": 0.2}
    containers = [make_container(outbox=settings, message_bus=PUBLISH) for _ in range(replicas)]
    handler = HangsOnce()
    for index, container in enumerate(containers):
        await install_kit(container, create_tables=index == 0)
        container.handlers().on_domain_event(Noted, handler)
    first = containers[0]
    for container in containers:
        await container.worker().start()
    try:
        await note(first, HANG)
        await eventually(lambda: handler.hung >= 1)
        await note(first, "one", "two")  # unrelated rows, committed while the handler hangs

        async def delivered() -> bool:
            rows = await noted_rows(first)
            return all(rows[text].processed_on is not None for text in ("one", "two"))

        await until(delivered, timeout=20)

        async def dead_lettered() -> bool:
            return (await noted_rows(first))[HANG].dead_lettered_on is not None

        await until(dead_lettered, timeout=30)
        hung = (await noted_rows(first))[HANG]
        assert (hung.dead_letter_reason, hung.retry_count) == ("retries_exhausted", 2)
        assert "delivery timed out after 1 s" in hung.last_error
        assert sorted(await _effects(first)) == ["noted:one", "noted:two"]
    finally:
        for container in containers:
            await asyncio.wait_for(container.worker().stop(), 30)


async def test_a_shortened_lease_alone_limits_every_delivery(make_container: ContainerFactory) -> None:
    """Only ``OUTBOX__LEASE_SECONDS`` set (2 s): the delivery's limit follows it (half the
    lease), so a handler that never returns is cut at 1 s, well inside its lease."""
    shortened = {"lease_seconds": 2, "processing_delay_seconds": 0, "immediate_dispatch": False}
    container = make_container(outbox={**shortened, "max_retries": 1, "retry_backoff_base_seconds": 0.2})
    assert container.settings().outbox.delivery_timeout_seconds == 1
    handler = HangsOnce()
    await install_kit(container)
    container.handlers().on_domain_event(Noted, handler)
    await container.worker().start()
    try:
        await note(container, HANG)

        async def dead_lettered() -> bool:
            return (await noted_rows(container))[HANG].dead_lettered_on is not None

        await until(dead_lettered, timeout=30)
        assert "delivery timed out after 1 s" in (await noted_rows(container))[HANG].last_error
    finally:
        await asyncio.wait_for(container.worker().stop(), 30)


async def test_an_internal_command_that_never_returns_holds_only_its_own_row(
    make_container: ContainerFactory,
) -> None:
    """The internal-command processor shares the core, and so the limit: a command whose handler
    hangs is charged per limit and dead-lettered; a command scheduled after it runs."""
    settings = {**LIMITED, "max_retries": 2, "retry_backoff_base_seconds": 0.2}
    container = make_container(outbox=settings, message_bus=PUBLISH)
    await install_kit(container)
    hung: list[str] = []

    async def run(command: RecordEffect, uow: SqlUnitOfWork) -> None:
        if command.label == HANG:
            hung.append(command.label)
            await asyncio.Event().wait()
        await record_effect(uow, command.label)

    container.handlers().on_command(RecordEffect, run)
    await container.worker().start()
    try:
        for label in (HANG, "after"):
            with acting_as():
                async with container.units_of_work()() as uow:
                    uow.schedule(RecordEffect(label=label))
                    await uow.commit()
            if label == HANG:
                await eventually(lambda: hung != [])

        async def finished() -> bool:
            rows = await fetch(container, sa.select(COMMAND_TABLE))
            return len(rows) == 2 and all(r.processed_on or r.dead_lettered_on for r in rows)

        await until(finished)
        rows = {r.payload["label"]: r for r in await fetch(container, sa.select(COMMAND_TABLE))}
        assert rows["after"].processed_on is not None
        assert (rows[HANG].dead_letter_reason, rows[HANG].retry_count) == ("retries_exhausted", 2)
        assert "delivery timed out after 1 s" in rows[HANG].last_error
        assert await _effects(container) == ["after"]
    finally:
        await asyncio.wait_for(container.worker().stop(), 30)


async def _effects(container: OutboxContainer) -> list[str]:
    from outbox_kit.testing.harness import effects

    async with container.database().session() as session:
        return await effects(session)


async def test_an_after_commit_dispatch_that_never_returns_gives_its_row_back(
    make_container: ContainerFactory,
) -> None:
    """The commit that wrote the row returns once the time limit ends; the row goes back to the
    processor with the reason, uncharged (an in-process attempt is never charged)."""
    container = make_container(outbox=LIMITED, message_bus=PUBLISH)
    await install_kit(container)
    handler = HangsOnce()
    container.handlers().on_domain_event(Noted, handler)
    await asyncio.wait_for(note(container, HANG), timeout=15)
    hung = (await noted_rows(container))[HANG]
    assert handler.hung == 1
    assert (hung.processed_on, hung.lock_token, hung.retry_count) == (None, None, 0)
    assert "delivery timed out after 1 s" in hung.last_error


@pytest.mark.slow
@pytest.mark.postgres
async def test_a_slow_publish_never_overlaps_another_replicas_copy_of_its_row(postgres_url: str) -> None:
    """Issue 22 item 8, scaled down: a 6 s lease and a 4 s time limit. Replica A publishes two
    rows one after the other; the second starts with 3.5 s of its claim's lease left (more than
    half, so it used to skip the renewal) and takes 3.9 s, just under the limit. Its lease must
    not end while that publish is in flight, or replica B claims the row and publishes it too."""
    lease = {"lease_seconds": 6, "delivery_timeout_seconds": 4}
    publish = {"publish_timeout_seconds": 3.95}  # below the delivery's limit, above the 3.9 s publish
    container = kit_container(make_settings(postgres_url, outbox=lease, message_bus=publish))
    try:
        await _two_replicas_publish(container)
    finally:
        await container.database().dispose()


async def _two_replicas_publish(container: OutboxContainer) -> None:
    now = container.clock()()
    ids = await insert_rows(
        container,
        [row("kit.a.v1", now, payload={"seconds": 2.5}), row("kit.a.v1", now, payload={"seconds": 3.9})],
    )
    in_flight: Tally[uuid.UUID] = Tally()
    overlaps: list[uuid.UUID] = []

    async def slow_publish(claimed: ClaimedRow) -> Delivered:
        in_flight[claimed.id] += 1
        if in_flight[claimed.id] > 1:
            overlaps.append(claimed.id)
        try:
            await asyncio.sleep(claimed.payload["seconds"])
        finally:
            in_flight[claimed.id] -= 1
        return Delivered.NEEDS_STAMP

    deliverer = ScriptedDeliverer(slow_publish, fresh_lease=False)  # a publish: renewed when short
    replica_a = outbox_source(container, deliverer, delivery_concurrency=1)
    replica_b = outbox_source(container, deliverer, delivery_concurrency=1)
    cycle_a = asyncio.create_task(replica_a.run_cycle())
    await eventually(lambda: len(deliverer.delivered) == 1)  # A holds both rows now

    async def replica_b_polls() -> None:
        while True:
            await replica_b.run_cycle()
            await asyncio.sleep(0.05)

    polling_b = asyncio.create_task(replica_b_polls())
    try:
        await asyncio.wait_for(cycle_a, timeout=30)
        await asyncio.sleep(0.5)  # B polls on past the end of A's publishes
    finally:
        polling_b.cancel()
        await asyncio.gather(polling_b, return_exceptions=True)
    assert overlaps == [], "a row was published by two replicas at once"
    assert sorted(r.id for r in deliverer.delivered) == sorted(ids)


async def test_a_follow_on_delivery_after_the_stamp_is_not_charged_to_the_stamped_row(
    make_container: ContainerFactory, database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The limit covers a row's handlers, not its commit: the commit stamps the row and then
    delivers the events its handlers raised (after-commit), each under its own limit. A quick
    handler whose follow-on event hangs must leave its row stamped, with no "lease lost" (log or
    ``outbox_lost_leases_total``), and the follow-on row failed by its own limit. Both paths: the
    processor (the row written by a producer-only host) and the API's after-commit dispatch."""
    writer = make_container(outbox={**LIMITED, "immediate_dispatch": False}, message_bus=PUBLISH)
    await install_kit(writer)
    container = make_container(
        outbox={**LIMITED, "max_retries": 5, "retry_backoff_base_seconds": 30}, message_bus=PUBLISH
    )
    await install_kit(container, create_tables=False)
    hangs = HangsOnce()

    async def raises_a_follow_on(event: Noted, uow: SqlUnitOfWork) -> None:
        if event.text in {"via-processor", "via-api"}:
            follow_on = Counter.create("acme")
            follow_on.note(HANG)
            uow.repository(Counters).add(follow_on)
            return
        await hangs(event, uow)

    container.handlers().on_domain_event(Noted, raises_a_follow_on)
    registry = container.metrics().registry

    def lost() -> float:
        return registry.get_sample_value("outbox_lost_leases_total", {"source": "outbox"}) or 0.0

    caplog.set_level(logging.WARNING)
    await note(writer, "via-processor")  # left to the processor
    await container.worker().start()
    try:

        async def followed_on() -> bool:
            first = (await noted_rows(container)).get("via-processor")
            return first is not None and first.processed_on is not None and hangs.hung >= 1

        await until(followed_on, timeout=20)
        await asyncio.sleep(2.5)  # past the first row's limit, had it covered the follow-on
    finally:
        await asyncio.wait_for(container.worker().stop(), 30)
    await asyncio.wait_for(note(container, "via-api"), timeout=15)  # dispatched after the commit
    await asyncio.sleep(0.5)
    rows = await fetch(container, sa.select(OUTBOX_TABLE).where(OUTBOX_TABLE.c.event_name == "kit.noted.v1"))
    stamped = [r for r in rows if r.payload["text"] != HANG]
    assert sorted(r.payload["text"] for r in stamped) == ["via-api", "via-processor"]
    assert all(r.processed_on is not None and r.retry_count == 0 for r in stamped), stamped
    follow_ons = [r for r in rows if r.payload["text"] == HANG]
    assert len(follow_ons) == 2
    assert hangs.hung >= 2
    for follow_on in follow_ons:
        assert follow_on.processed_on is None
        assert "delivery timed out after 1 s" in (follow_on.last_error or "")
    assert lost() == 0.0
    messages = [record.getMessage() for record in caplog.records]
    assert not [m for m in messages if "lease lost" in m], messages
    stamped_ids = {str(r.id) for r in stamped}
    misreported = [m for m in messages if "will retry" in m and any(i in m for i in stamped_ids)]
    assert misreported == []


class HangsOnOne:
    """A consumer that never returns for the counter ``hung``; other events record an effect."""

    def __init__(self, name: str, *, hangs_on: str | None) -> None:
        self.name = name
        self.hangs_on = hangs_on
        self.hung = 0

    async def __call__(self, event: CounterChangedV1, uow: SqlUnitOfWork) -> None:
        if event.counter_id == self.hangs_on:
            self.hung += 1
            await asyncio.Event().wait()
        await record_effect(uow, f"{self.name}:{event.counter_id}")


async def change(container: OutboxContainer, counter_id: str) -> None:
    with acting_as():
        async with container.units_of_work()() as uow:
            uow.enqueue(CounterChangedV1(counter_id=counter_id, value=1))
            await uow.commit()


def consumers(container: OutboxContainer) -> HangsOnOne:
    """A consumer that hangs on ``hung``, registered before one that never does."""
    hanging = HangsOnOne("hanging", hangs_on="hung")
    container.handlers().consume("hanging", CounterChangedV1, hanging)
    container.handlers().consume("steady", CounterChangedV1, HangsOnOne("steady", hangs_on=None))
    return hanging


async def test_an_in_process_consumer_that_never_returns_is_timed_out_without_the_outbox(
    make_container: ContainerFactory,
) -> None:
    """The default in-process transport without the outbox publishes in the committing request:
    a consumer that hangs is cut at ``MESSAGE_BUS__HANDLER_TIMEOUT_SECONDS``; the request returns,
    the event's other consumer ran, and later events are consumed."""
    bus = {**PUBLISH, "enable_outbox": False, "enable_inbox": False}
    container = make_container(outbox=LIMITED, message_bus=bus)
    await install_kit(container)
    hanging = consumers(container)
    await asyncio.wait_for(change(container, "hung"), timeout=15)
    await asyncio.wait_for(change(container, "other"), timeout=15)
    assert hanging.hung == 1
    assert sorted(await _effects(container)) == ["hanging:other", "steady:hung", "steady:other"]


async def test_an_in_process_consumer_that_never_returns_fails_only_its_own_attempt(
    make_container: ContainerFactory,
) -> None:
    """With the outbox, the hung consumer fails its attempt at its own limit (shorter than the
    delivery's): the event's other consumer runs on every attempt (the inbox keeps it to one
    effect), unrelated rows are delivered, and the hung row ends dead-lettered with the reason."""
    outbox = {**LIMITED, "max_retries": 2, "retry_backoff_base_seconds": 0.2}
    container = make_container(outbox=outbox, message_bus=PUBLISH)
    await install_kit(container)
    hanging = consumers(container)
    await container.worker().start()
    try:
        await change(container, "hung")
        await eventually(lambda: hanging.hung >= 1)
        await change(container, "other")

        async def dead_lettered() -> bool:
            rows = await fetch(container, sa.select(OUTBOX_TABLE).where(OUTBOX_TABLE.c.kind == "integration"))
            by_id = {r.payload["counter_id"]: r for r in rows}
            return "other" in by_id and by_id["hung"].dead_lettered_on is not None

        await until(dead_lettered, timeout=30)
        rows = await fetch(container, sa.select(OUTBOX_TABLE).where(OUTBOX_TABLE.c.kind == "integration"))
        by_id = {r.payload["counter_id"]: r for r in rows}
        assert by_id["other"].processed_on is not None
        assert (by_id["hung"].dead_letter_reason, by_id["hung"].retry_count) == ("retries_exhausted", 2)
        assert "hanging: TimeLimitExceededError: handler timed out after 0.5 s" in by_id["hung"].last_error
        assert sorted(await _effects(container)) == ["hanging:other", "steady:hung", "steady:other"]
    finally:
        await asyncio.wait_for(container.worker().stop(), 30)
