"""Messages of one consumer that are ready together are consumed in one transaction
(``consume.batch``, "Batches" in ``consume.inbox``), on PostgreSQL and real brokers: each keeps
its own context, a poison message fails alone, a copy in the same batch is a duplicate, and a
batch whose commit fails runs each message alone. The collector itself is tested without
services at the end."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pytest
import sqlalchemy as sa
from outbox_kit.application.context import capture_context
from outbox_kit.consume.batch import PATIENCE_SECONDS, Batches, Submitted
from outbox_kit.persistence.tables import INBOX_TABLE, OUTBOX_TABLE
from outbox_kit.persistence.unit_of_work import SharedTransaction, SqlUnitOfWork, UnitOfWorkStateError
from outbox_kit.runtime.container import OutboxContainer
from outbox_kit.testing.fixtures import (
    SERVICE_URLS,
    acting_as,
    eventually,
    fetch,
    kit_container,
    make_settings,
)
from outbox_kit.testing.harness import (
    CONSUMER,
    EFFECTS,
    Counter,
    CounterChangedV1,
    Counters,
    Noted,
    record_effect,
)
from outbox_kit.transports.copies import DeadLetterCopy
from outbox_kit.transports.envelope import Envelope
from outbox_kit.transports.rabbit import RabbitTransport
from test_brokers import TRANSPORTS, Observer, Start
from test_brokers import start as start  # the fixture  # noqa: PLC0414

pytestmark = [pytest.mark.integration, pytest.mark.postgres]
BATCHING = [t for t in TRANSPORTS if t.values[0] in {"rabbitmq", "nats"}]  # they hand over several at once
GATE = 0  # the value whose handler waits until every other message is waiting behind it


def envelope_as(value: int, tenant: str) -> Envelope:
    with acting_as(tenant=tenant, correlation_id=f"corr-{value}"):
        context = capture_context()
    body = json.dumps(CounterChangedV1(counter_id="c", value=value).model_dump(mode="json")).encode()
    return Envelope(str(uuid.uuid4()), "kit.counter-changed.v1", datetime.now(UTC), body, context)


@dataclass
class Batching(Observer):
    """Records the transaction each run was in; the gate message waits for ``release``; values in
    ``poison`` always fail; ``notes`` raise a domain event (an outbox row of the message's context)."""

    release: asyncio.Event = field(default_factory=asyncio.Event)
    poison: set[int] = field(default_factory=set)
    sessions: dict[int, set[int]] = field(default_factory=dict)
    entered: set[int] = field(default_factory=set)
    notes: bool = False
    keyed: dict[int, str] = field(default_factory=dict)  # value -> a key of the deferred-unique table

    async def __call__(self, event: CounterChangedV1, uow: SqlUnitOfWork) -> None:
        self.entered.add(event.value)
        if event.value == GATE:
            await self.release.wait()
        self.sessions.setdefault(event.value, set()).add(id(uow.session))
        if event.value in self.poison:
            msg = f"poison {event.value}"
            raise RuntimeError(msg)
        if event.value in self.keyed:
            await uow.session.exec(  # type: ignore[call-overload]
                sa.text("INSERT INTO batch_keys (key) VALUES (:k)"), params={"k": self.keyed[event.value]}
            )
        if self.notes:
            counter = Counter.create("acme")
            counter.note(f"note:{event.value}")
            uow.repository(Counters).add(counter)
        await super().__call__(event, uow)


async def publish_gated(
    container: OutboxContainer, observer: Batching, envelopes: Sequence[Envelope]
) -> None:
    """Publish the gate message, then the others while its handler waits, then open the gate:
    everything after the gate is ready at once."""
    bus = container.bus()
    await bus.publish(envelope_as(GATE, "gate"))
    await eventually(lambda: GATE in observer.entered, timeout=20)
    for message in envelopes:
        await bus.publish(message)
    await asyncio.sleep(0.5)  # delivered to the consumer, waiting behind the gate
    observer.release.set()


async def dead_letters_become(container: OutboxContainer, count: int) -> list[DeadLetterCopy]:
    """The consumer's dead letters once there are ``count`` (RabbitMQ's are taken as they are
    read, the other brokers' only read)."""
    bus = container.bus()
    taken = isinstance(bus, RabbitTransport)
    found: list[DeadLetterCopy] = []
    deadline = asyncio.get_running_loop().time() + 30
    while len(found) < count:
        assert asyncio.get_running_loop().time() < deadline, f"dead letters: {found}, expected {count}"
        await asyncio.sleep(0.2)
        read = await bus.dead_letters(CONSUMER)
        found = [*found, *read] if taken else read
    return found


async def effects_once(container: OutboxContainer, prefix: str, count: int) -> dict[str, str | None]:
    """The effects (label -> tenant) once ``count`` labelled ``prefix...`` have committed: a
    handler returns before its unit of work commits what it recorded."""
    deadline = asyncio.get_running_loop().time() + 30
    while True:
        effects = {row.label: row.tenant_id for row in await fetch(container, sa.select(EFFECTS))}
        if sum(label.startswith(prefix) for label in effects) >= count:
            return effects
        assert asyncio.get_running_loop().time() < deadline, f"{prefix}: {sorted(effects)}"
        await asyncio.sleep(0.05)


def sample(container: OutboxContainer, name: str) -> float:
    return container.metrics().registry.get_sample_value(name, {"consumer": CONSUMER}) or 0.0


@pytest.mark.parametrize("transport", BATCHING)
async def test_messages_ready_together_share_a_transaction_and_each_keeps_its_context(
    start: Start, postgres_url: str, transport: str
) -> None:
    """Nine messages of three tenants wait behind the gate: fewer transactions than messages,
    and each message's effect, inbox row and outbox row (a domain event its handler raised,
    dispatched in-process after the commit) carry its own tenant and correlation."""
    observer = Batching(notes=True)
    container, _ = await start(transport, database_url=postgres_url, observer=observer)
    noted: list[str] = []

    async def on_noted(event: Noted, uow: SqlUnitOfWork) -> None:
        noted.append(event.text)
        await record_effect(uow, f"noted:{event.text}")

    container.handlers().on_domain_event(Noted, on_noted)
    tenants = {value: f"tenant-{value % 3}" for value in range(1, 10)}
    await publish_gated(container, observer, [envelope_as(v, t) for v, t in tenants.items()])
    await eventually(lambda: len(noted) == 10, timeout=30)
    after_gate = {next(iter(observer.sessions[v])) for v in tenants}
    assert len(after_gate) < len(tenants), "every message had a transaction of its own"
    effects = await effects_once(container, "noted:", 10)
    assert {f"consumed:{v}": t for v, t in tenants.items()}.items() <= effects.items()
    assert {f"noted:note:{v}": t for v, t in tenants.items()}.items() <= effects.items()
    inbox = await fetch(container, sa.select(INBOX_TABLE))
    assert len(inbox) == 10
    by_correlation = {row.correlation_id: row.tenant_id for row in inbox}
    assert {f"corr-{v}": t for v, t in tenants.items()}.items() <= by_correlation.items()
    domain_rows = await fetch(container, sa.select(OUTBOX_TABLE).where(OUTBOX_TABLE.c.kind == "domain"))
    notes = {
        row.payload["text"]: (row.tenant_id, row.correlation_id)
        for row in domain_rows
        if "text" in row.payload
    }
    assert {f"note:{v}": (t, f"corr-{v}") for v, t in tenants.items()}.items() <= notes.items()
    assert sample(container, "inbox_consumed_total") == 10


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_poison_message_fails_alone_and_costs_its_neighbours_no_attempt(
    start: Start, postgres_url: str, transport: str
) -> None:
    """Value 5 always fails: it alone is charged (one failure per attempt, then dead-lettered);
    every other message has exactly one effect and no failure."""
    observer = Batching(poison={5})
    container, _ = await start(transport, database_url=postgres_url, observer=observer)
    values = range(1, 10)
    await publish_gated(container, observer, [envelope_as(v, "acme") for v in values])

    copies = await dead_letters_become(container, 1)
    labels = [row.label for row in await fetch(container, sa.select(EFFECTS))]
    assert sorted(labels) == sorted([f"consumed:{v}" for v in [GATE, *values] if v != 5])
    assert sample(container, "inbox_failures_total") == 3  # max_delivery_attempts: the poison's own
    (copy,) = copies
    assert "poison 5" in copy.error


@pytest.mark.rabbitmq
async def test_a_copy_in_the_same_batch_is_a_duplicate(start: Start, postgres_url: str) -> None:
    """The same message twice behind the gate (a relay that published it again): one effect, one
    duplicate. (JetStream drops a second publish of a message id itself.)"""
    observer = Batching()
    container, _ = await start("rabbitmq", database_url=postgres_url, observer=observer)
    twice = envelope_as(2, "acme")
    await publish_gated(container, observer, [envelope_as(1, "acme"), twice, twice, envelope_as(3, "acme")])
    await eventually(lambda: sample(container, "inbox_consumed_total") == 4, timeout=30)
    assert sample(container, "inbox_duplicates_total") == 1
    labels = sorted(row.label for row in await fetch(container, sa.select(EFFECTS)))
    assert labels == ["consumed:0", "consumed:1", "consumed:2", "consumed:3"]
    assert observer.sessions[1] == observer.sessions[2]  # one batch, the copy in its next round


@pytest.mark.rabbitmq
async def test_a_batch_whose_commit_fails_runs_each_message_alone(start: Start, postgres_url: str) -> None:
    """Values 1 and 2 insert the same key into a table whose unique constraint is checked at
    COMMIT: the batch's commit fails for neither in particular, so each runs alone; 1 and 3 are
    consumed, 2 fails on its own (charged, then dead-lettered) and nothing is lost."""
    observer = Batching(keyed={1: "same", 2: "same", 3: "other"})
    container, _ = await start("rabbitmq", database_url=postgres_url, observer=observer)
    async with container.database().engine.begin() as connection:
        await connection.execute(sa.text("DROP TABLE IF EXISTS batch_keys"))
        await connection.execute(
            sa.text("CREATE TABLE batch_keys (key TEXT, UNIQUE (key) DEFERRABLE INITIALLY DEFERRED)")
        )
    await publish_gated(container, observer, [envelope_as(v, "acme") for v in (1, 2, 3)])
    (copy,) = await dead_letters_become(container, 1)
    labels = sorted(row.label for row in await fetch(container, sa.select(EFFECTS)))
    assert labels == ["consumed:0", "consumed:1", "consumed:3"]
    assert len(observer.sessions[1] | observer.sessions[2]) >= 3  # together once, then each alone
    assert "UniqueViolation" in copy.error or "unique" in copy.error.lower()


async def test_a_unit_of_work_that_shares_a_transaction_never_commits_it_itself(postgres_url: str) -> None:
    """``commit()`` of a unit of work on a shared transaction is refused: only its owner commits."""
    container = kit_container(make_settings(postgres_url))
    units = container.units_of_work()
    session = container.database().sessions()
    try:
        shared = SharedTransaction(session, units.writer.new_lease(units.clock()))
        async with units(shared=shared) as uow:
            with pytest.raises(UnitOfWorkStateError, match="shares its transaction"):
                await uow.commit()
    finally:
        await session.close()
        await container.database().dispose()


# -- the collector, without services -------------------------------------------------------------


@dataclass
class Recorded:
    """A batch runner that records its batches and settles each item with its body."""

    batches: list[list[bytes]] = field(default_factory=list)
    hold: asyncio.Event | None = None

    async def __call__(self, items: Sequence[Submitted[bytes]]) -> None:
        self.batches.append([item.body for item in items])
        if self.hold is not None:
            await self.hold.wait()
        for item in items:
            item.settle(item.body)


async def test_messages_submitted_together_are_one_batch_and_a_lone_one_runs_at_once() -> None:
    run = Recorded()
    batches: Batches[bytes] = Batches(run, size=3)
    results = await asyncio.gather(*(batches.submit({}, str(n).encode()) for n in range(5)))
    assert results == [str(n).encode() for n in range(5)]
    assert run.batches == [[b"0", b"1", b"2"], [b"3", b"4"]]
    assert await batches.submit({}, b"alone") == b"alone"
    assert run.batches[-1] == [b"alone"]


async def test_what_arrives_while_a_batch_runs_makes_the_next_batch() -> None:
    hold = asyncio.Event()
    run = Recorded(hold=hold)
    batches: Batches[bytes] = Batches(run, size=10)
    first = asyncio.ensure_future(batches.submit({}, b"first"))
    await asyncio.sleep(0.01)
    later = [asyncio.ensure_future(batches.submit({}, f"later-{n}".encode())) for n in range(3)]
    await asyncio.sleep(0.01)
    assert run.batches == [[b"first"]]
    run.hold = None
    hold.set()
    await asyncio.gather(first, *later)
    assert run.batches == [[b"first"], [b"later-0", b"later-1", b"later-2"]]


async def test_a_leader_cancelled_mid_batch_hands_its_unsettled_items_to_the_next() -> None:
    hold = asyncio.Event()
    run = Recorded(hold=hold)
    batches: Batches[bytes] = Batches(run, size=10)
    leader = asyncio.ensure_future(batches.submit({}, b"leader"))
    others = [asyncio.ensure_future(batches.submit({}, f"other-{n}".encode())) for n in range(2)]
    await asyncio.sleep(0.01)
    assert run.batches == [[b"leader", b"other-0", b"other-1"]]
    leader.cancel()
    await asyncio.sleep(0.01)
    run.hold = None
    hold.set()
    assert await asyncio.gather(*others) == [b"other-0", b"other-1"]
    assert run.batches[-1] == [b"other-0", b"other-1"]  # the leader's own item went with its task
    assert leader.cancelled()


async def test_a_failure_the_runner_sets_reaches_only_its_message() -> None:
    async def run(items: Sequence[Submitted[str]]) -> None:
        for item in items:
            if item.body == b"bad":
                item.fail(ValueError("bad"))
            else:
                item.settle("ok")

    batches: Batches[str] = Batches(run, size=10)
    outcomes: list[Any] = await asyncio.gather(
        batches.submit({}, b"good"),
        batches.submit({}, b"bad"),
        batches.submit({}, b"good"),
        return_exceptions=True,
    )
    assert outcomes[0] == outcomes[2] == "ok"
    assert isinstance(outcomes[1], ValueError)


async def test_a_slow_batch_holds_up_only_itself_while_others_may_run() -> None:
    """With room for two batches at once, messages that arrive while one batch is stuck (a slow
    handler) run in a second batch meanwhile."""
    hold = asyncio.Event()

    async def run(items: Sequence[Submitted[bytes]]) -> None:
        if any(item.body == b"slow" for item in items):
            await hold.wait()
        for item in items:
            item.settle(item.body)

    batches: Batches[bytes] = Batches(run, size=10, concurrency=2)
    slow = asyncio.ensure_future(batches.submit({}, b"slow"))
    await asyncio.sleep(0.01)
    assert (
        await asyncio.wait_for(asyncio.gather(*(batches.submit({}, b"quick") for _ in range(3))), 5)
        == [b"quick"] * 3
    )
    assert not slow.done()
    hold.set()
    assert await slow == b"slow"


async def test_messages_behind_a_quick_batch_wait_for_it_rather_than_start_small_ones() -> None:
    """With room for four batches, messages that arrive while a batch runs for less than the
    patience wait and make one full batch after it (not a batch of their own each)."""
    run = Recorded(hold=asyncio.Event())
    batches: Batches[bytes] = Batches(run, size=10, concurrency=4)
    first = asyncio.ensure_future(batches.submit({}, b"first"))
    await asyncio.sleep(0.005)
    later = [asyncio.ensure_future(batches.submit({}, f"later-{n}".encode())) for n in range(3)]
    await asyncio.sleep(PATIENCE_SECONDS / 5)
    assert run.batches == [[b"first"]]
    hold, run.hold = run.hold, None
    assert hold is not None
    hold.set()
    await asyncio.gather(first, *later)
    assert run.batches == [[b"first"], [b"later-0", b"later-1", b"later-2"]]


@pytest.mark.rabbitmq
async def test_a_rabbitmq_consumer_takes_no_more_than_it_can_work_on(start: Start, postgres_url: str) -> None:
    """The consumer's prefetch is twice its batch size times its concurrency (here 2 x 2 x 1):
    while the gate's handler waits, the process holds four of the eleven messages and the other
    seven stay in the queue (for another replica, and out of this process's memory); opened,
    all are consumed."""
    import aio_pika

    observer = Batching()
    bus_settings = {"consume_batch_size": 2, "consume_concurrency": 1}
    container, _ = await start(
        "rabbitmq", database_url=postgres_url, observer=observer, message_bus=bus_settings
    )
    bus = container.bus()
    await bus.publish(envelope_as(GATE, "gate"))
    await eventually(lambda: GATE in observer.entered, timeout=20)
    for value in range(1, 11):
        await bus.publish(envelope_as(value, "acme"))
    queue_name = bus.names.queue(CONSUMER)  # type: ignore[attr-defined]

    async def ready_in_queue() -> int:
        connection = await aio_pika.connect(SERVICE_URLS["rabbitmq"])
        async with connection:
            queue = await (await connection.channel()).declare_queue(queue_name, passive=True)
            return int(queue.declaration_result.message_count or 0)

    waiting = 0
    for _ in range(100):  # the publishes reach the queue (confirmed) and settle there
        waiting = await ready_in_queue()
        if waiting == 7:
            break
        await asyncio.sleep(0.05)
    assert waiting == 7, "the consumer took more than its prefetch"
    observer.release.set()
    await eventually(lambda: sample(container, "inbox_consumed_total") == 11, timeout=30)
    assert await ready_in_queue() == 0
