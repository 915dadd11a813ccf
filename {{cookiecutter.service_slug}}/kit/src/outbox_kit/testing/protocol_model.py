"""A property-based model of the relay protocol, played against the real outbox tables on PostgreSQL.

Hypothesis (stateful testing) plays random sequences of the protocol's steps. Every step runs
production code: three processors (``TableSource``, instance ids ``processor-a/b/c``) drain the
real ``outbox_messages`` table with the real claim statement, lease renewal, token-guarded
outcome writes, failure charging, dead-lettering and shutdown release; an operator replays dead
letters through ``RelayAdministration.replay``; deliveries go through the real outbox deliverer
and the in-process bus into the real ``ConsumePipeline`` with its inbox. Beside it runs a model
in plain Python of what the tables must hold. After every step the two are compared and the
invariants below are checked; when one breaks, Hypothesis shrinks the run to a short sequence of
steps and prints it.

How a delivery is driven. Each processor runs a real cycle (``run_cycle``: claim a batch, then
renew -> deliver -> record, one row at a time). Its deliverer holds every row at a gate until a
step decides how the delivery goes, then runs the service's own ``OutboxDeliverer``: the message
is published to a consumer whose handler writes one effect row in the inbox's transaction. So a
delivery can outlive its lease while other processors act, which is how stale tokens arise.

The steps (rules). A run starts with a backlog of three to six messages, after an outage of
their consumer half the time (every row that could be claimed then has failed once, so one more
failure dead-letters it and the deeper states are a few steps away). Then, in random order:

* **enqueue** a message through a unit of work (two ordering keys, several messages a key, and
  keyless ones);
* **claim**: an idle processor starts a cycle (the claim statement, then the renewal before the
  first row is dispatched); the model predicts exactly which rows it takes;
* **renew**: a processor renews the lease of the row it is delivering (``Outcomes.renew``), some
  time after it was taken: it must succeed only while the row still carries its token;
* **consume**: the held delivery goes through, its consumer takes the message (or the inbox skips
  it as a duplicate), and the outcome is stamped under the processor's token;
* **fail**: the consumer's handler raises (its effect and inbox row roll back); a retry is
  charged and the row backs off;
* **dead-letter**: the same on the row's last attempt: the row is dead-lettered;
* **expire**: time passes beyond every lease (31 s); **time passes** (11 s) ends a backoff but not
  a lease renewed since;
* **replay**: the operator returns a dead letter to the pending pool;
* **redeliver**: the broker hands a published message to the consumer again (at-least-once);
* **shutdown**: a processor stops mid-batch (its cycle is cancelled): the interrupted row and the
  unreached ones are released, no retry charged.

The invariants, and why each matters to a user of the service:

* **no loss**: every row written is still in the table, in exactly one state (pending,
  processed, dead-lettered), and a row stamped processed really reached its consumer. At the end
  of every run the model drains the table (replaying the dead letters once) and every message
  must have been consumed exactly once: nothing an aggregate wrote is silently dropped.
* **no outcome by a stale token**: the model applies an outcome only when the writer still
  holds the row's token; any difference between the table and the model is a write that the
  token guard should have refused (or one that was lost). A processor whose lease ran out and
  whose row another processor took must not stamp, fail, dead-letter or release that row.
* **at most one live lease per row**: a processor that is still within its lease (by the end it
  last wrote) is the row's only holder, and a key has at most one row in flight. This is what
  makes a lease mean something: within it, nobody else delivers the row.
* **per-key order**: the claim would take only the head of each key (no earlier row of the key
  still pending) and never two rows of one key; and the consumer's effects of the messages of a
  key come in the order they were written (a message that was ever dead-lettered is exempt: a
  dead letter steps aside so its key can move on, and a replay puts it back later).
* **dead letters release their key**: a row whose earlier key-mates are all processed or
  dead-lettered, with no lease on it and no key-mate in flight, is claimable: one poison message
  must not stop its key for ever. The claimable set is probed with the real claim statement,
  rolled back, after every step.
* **exactly one effect per message**: the inbox turns redeliveries, and deliveries by a processor
  whose lease was taken over, into skipped duplicates.

Time. Every time value the protocol uses comes from the application clock and is bound into the
SQL as a parameter (the claim's ``now``, lease ends, backoffs, outcome stamps); nothing reads the
database's ``now()``. So the clock here is a fake one the model moves by hand: **expire** ends
leases at once, without sleeping. The backoff's jitter is pinned to 1.0, so the model knows when
a failed row is due again.

One behaviour of the claim the model spells out rather than hides: it keeps at most ``batch``
heads of keys *before* it drops those whose key has another row in flight (only a replayed dead
letter can be such a head), so blocked heads can take the places of free heads of other keys,
which then wait a cycle more (see ``expected_claim``; with two keys and batches of two it cannot
happen here).

Running it: a sync test, so Hypothesis's steps can drive the service's coroutines on an event
loop of the test's own (an ``asyncio.Runner``), apart from the loop the async tests share. Held
deliveries stay suspended on that loop between steps. A passing run takes well under a minute;
a failing one is then shrunk by Hypothesis for up to five minutes before the shortest steps it
found are printed (hence the test's own timeout). Runs are not saved to a ``.hypothesis``
folder (``database=None``): the printed steps reproduce a failure.
"""

from __future__ import annotations

import asyncio
import random
import sys
import uuid
from collections import Counter, defaultdict
from collections.abc import Coroutine, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from enum import Enum
from typing import Any, TypeVar

import pytest
import sqlalchemy as sa
from dependency_injector import providers
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox_kit.application.clock import TimeLimit
from outbox_kit.application.handlers import Consumer, Handler
from outbox_kit.application.messages import (
    IntegrationEvent,
)
from outbox_kit.application.tracing import SpanKind
from outbox_kit.application.unit_of_work import (
    UnitOfWork,
)
from outbox_kit.consume.inbox import (
    ConsumeOutcome,
)
from outbox_kit.persistence.tables import (
    INBOX_TABLE,
    OUTBOX_TABLE,
    DeadLetterReplay,
)
from outbox_kit.persistence.unit_of_work import SqlUnitOfWork
from outbox_kit.processor.claim import (
    ClaimedRow,
    Claimer,
)
from outbox_kit.processor.cycle import (
    TableSource,
)
from outbox_kit.processor.deliverers import (
    OutboxDeliverer,
)
from outbox_kit.processor.processor import (
    CycleResult,
    SourceSettings,
)
from outbox_kit.runtime.container import (
    OutboxContainer,
    source_settings,
)
from outbox_kit.testing.fixtures import ContainerBuilder, longest_delivery, make_settings
from outbox_kit.testing.harness import FakeClock
from outbox_kit.transports.bus import (
    Delivered,
    MessageBus,
    PublishResult,
    Unrouted,
)
from outbox_kit.transports.envelope import (
    Envelope,
)

__all__ = ["test_the_relay_protocol_keeps_its_invariants"]  # what a service's test module imports
T = TypeVar("T")

LEASE_SECONDS = 30.0
BACKOFF_BASE_SECONDS = 10.0  # the first (and, with two attempts, only) backoff
MAX_RETRIES = 2  # the second failed attempt dead-letters: dead letters and replays come often
BATCH_SIZE = 2  # small, so a claim leaves rows to the other processors
PROCESSORS = ("processor-a", "processor-b", "processor-c")
KEYS = ("k1", "k2", None)  # two ordering keys, and keyless messages
MAX_BACKLOG = 6  # pending rows: enough to interleave keys and processors, few enough to drain
PAST_A_BACKOFF_SECONDS = 11.0  # a third of a lease: a renewed lease outlives an old one
PAST_EVERY_LEASE_SECONDS = 31.0
STEP_TIMEOUT_SECONDS = 20.0
CONSUMER = "model.consumer"
PENDING, PROCESSED, DEAD = "pending", "processed", "dead-lettered"

SETTINGS = settings(
    max_examples=20,
    stateful_step_count=50,
    deadline=None,  # a step is a few database round trips; their time varies with the machine
    # No "explain" phase: it replays the failure many more times (minutes here) for a hint that
    # the printed steps already give.
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    database=None,  # the service's tree ignores no .hypothesis/ folder; a failure prints its steps
    suppress_health_check=[HealthCheck.too_slow],
)

REPLAYS_TABLE: sa.Table = DeadLetterReplay.__table__  # type: ignore[attr-defined]
EFFECTS_METADATA = sa.MetaData()
EFFECTS = sa.Table(  # one row per handler run that committed: a duplicate effect would show
    "model_effects",
    EFFECTS_METADATA,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("label", sa.String(64), nullable=False),
)


class ModelStepV1(IntegrationEvent, name="model.step.v1", ordered=True):
    """One message of a run; ``label`` names it in the model and in failure reports."""

    label: str


class ConsumerRefusedError(RuntimeError):
    """The consumer's handler failed (a **fail** or **dead-letter** step)."""


class NoJitter(random.Random):
    """The backoff without its jitter, so the model knows when a failed row is due again."""

    def uniform(self, a: float, b: float) -> float:
        del a, b
        return 1.0


def backoff(attempt: int) -> timedelta:
    """What ``retries.backoff_seconds`` gives without jitter: doubling, capped by the lease."""
    return timedelta(seconds=min(BACKOFF_BASE_SECONDS * 2 ** (attempt - 1), LEASE_SECONDS))


# -- the service's side: the bus, the gated deliverer, the processors ---------------------------


class RecordingBus:
    """The service's in-process bus, keeping the last envelope of each message it published, so
    a broker's redelivery of it can be played later (**redeliver**)."""

    name = "recording"

    def __init__(self, inner: MessageBus) -> None:
        self._inner = inner
        self.sent: dict[str, Envelope] = {}

    async def start(self) -> None:
        await self._inner.start()

    async def start_consuming(self) -> None:
        await self._inner.start_consuming()

    async def stop(self) -> None:
        await self._inner.stop()

    async def ping(self) -> None:
        await self._inner.ping()

    async def publish(self, envelope: Envelope) -> Unrouted | None:
        self.sent[envelope.message_id] = envelope
        return await self._inner.publish(envelope)

    async def publish_batch(self, envelopes: Sequence[Envelope], window: int) -> list[PublishResult]:
        self.sent.update((envelope.message_id, envelope) for envelope in envelopes)
        return await self._inner.publish_batch(envelopes, window)


class Verdict(Enum):
    DELIVER = "deliver"
    REFUSE = "refuse"  # the consumer's handler raises during this delivery


@dataclass
class Held:
    """A delivery waiting at the gate for a step to decide how it goes."""

    row: ClaimedRow
    token: uuid.UUID
    verdict: asyncio.Future[Verdict]


class GatedDeliverer:
    """Holds each delivery until a step lets it go, then runs the service's outbox deliverer."""

    def __init__(self, inner: OutboxDeliverer, refusing: set[str]) -> None:
        self._inner = inner
        self._refusing = refusing
        self.held: Held | None = None
        self.arrived = asyncio.Event()

    def publishes(self, row: ClaimedRow) -> bool:
        """Never as a batch: the model holds and decides each row's delivery on its own (the
        service's deliverer publishes it as a batch of one)."""
        del row
        return False

    async def deliver_published(
        self, rows: Sequence[ClaimedRow], window: int, limit: TimeLimit
    ) -> list[Delivered | Unrouted | BaseException]:
        return await self._inner.deliver_published(rows, window, limit)

    def needs_fresh_lease(self, row: ClaimedRow) -> bool:
        """Always renew: the model's cycle renews before each dispatch (the renewal a publish
        skips while its lease is young is covered by the processor tests)."""
        del row
        return True

    def span_kind(self, row: ClaimedRow) -> SpanKind:
        return self._inner.span_kind(row)

    async def deliver(self, row: ClaimedRow, token: uuid.UUID, limit: TimeLimit) -> Delivered | Unrouted:
        verdict: asyncio.Future[Verdict] = asyncio.get_running_loop().create_future()
        self.held = Held(row, token, verdict)
        self.arrived.set()
        # The hold is outside the delivery's time limit: the limit runs on the loop's real
        # clock, and a hold spans steps (a shutdown step waits seconds of real time), so a
        # delivery held across a few of them would time out, a failure no step decided. The
        # limit itself is proven by the time-limit tests; the delivery below runs inside it.
        try:
            decided = await verdict
        finally:
            self.held = None
        if decided is Verdict.DELIVER:
            return await self._inner.deliver(row, token, limit)
        label = str(row.payload["label"])
        self._refusing.add(label)
        try:
            return await self._inner.deliver(row, token, limit)
        finally:
            self._refusing.discard(label)


class ObservedSource(TableSource):
    """The real source; it only remembers what its last claim returned, for the model."""

    last_claim: tuple[uuid.UUID, list[ClaimedRow]] | None = None

    async def claim(self, token: uuid.UUID, now: datetime | None = None) -> list[ClaimedRow]:
        rows = await super().claim(token, now)
        self.last_claim = (token, rows)
        return rows


@dataclass
class Processor:
    name: str
    source: ObservedSource
    deliverer: GatedDeliverer
    cycle: asyncio.Task[CycleResult] | None = None


@dataclass
class World:
    """What every run shares (building it per run would cost seconds): the event loop, the
    container on the test database with the consumer registered, the clock and the bus."""

    runner: asyncio.Runner
    container: OutboxContainer
    clock: FakeClock
    bus: RecordingBus
    deliverer: OutboxDeliverer
    consumer: Consumer[Any]
    refusing: set[str]
    source_settings: SourceSettings
    probe: Claimer  # the claim statement with room for every row, run and rolled back

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return self.runner.run(coroutine)

    def processor(self, name: str) -> Processor:
        deliverer = GatedDeliverer(self.deliverer, self.refusing)
        source = ObservedSource(
            name="outbox",
            table=OUTBOX_TABLE,
            name_column="event_name",
            settings=self.source_settings,
            database=self.container.database(),
            deliverer=deliverer,
            clock=self.clock,
            instance_id=name,
            metrics=self.container.metrics(),
            rng=NoJitter(),
        )
        return Processor(name, source, deliverer)

    async def reset(self) -> None:
        """Empty the tables a run writes and start the clock at the real time again."""
        async with self.container.database().engine.begin() as connection:
            for table in (OUTBOX_TABLE, INBOX_TABLE, REPLAYS_TABLE, EFFECTS):
                await connection.execute(sa.delete(table))  # a few rows: cheaper than TRUNCATE
            # seq from 1 again, so a failure report's row numbers are small
            await connection.execute(sa.text(f"ALTER TABLE {OUTBOX_TABLE.name} ALTER COLUMN seq RESTART"))
        self.clock.now = datetime.now(UTC)
        self.bus.sent.clear()
        self.refusing.clear()


def recording_handler(refusing: set[str]) -> Handler[ModelStepV1]:
    """The consumer: one effect row per message, in the inbox's transaction; it raises after
    writing when the step refuses the delivery, so the rollback must take the effect back."""

    async def handler(event: ModelStepV1, uow: UnitOfWork) -> None:
        assert isinstance(uow, SqlUnitOfWork)
        await uow.session.exec(sa.insert(EFFECTS).values(label=event.label))
        if event.label in refusing:
            msg = f"the consumer refused {event.label}"
            raise ConsumerRefusedError(msg)

    return handler


@contextmanager
def open_world(build: ContainerBuilder, database_url: str) -> Iterator[World]:
    clock = FakeClock()
    outbox = {
        "lease_seconds": LEASE_SECONDS,
        "delivery_timeout_seconds": longest_delivery(LEASE_SECONDS),
        "max_retries": MAX_RETRIES,
        "retry_backoff_base_seconds": BACKOFF_BASE_SECONDS,
        "batch_size": BATCH_SIZE,
        "delivery_concurrency": 1,  # one row at a time: the rest of a batch is "not reached"
        # A held delivery ends only when a step decides, so each shutdown step waits out half
        # of this for it: short, yet long enough for the releases on a loaded machine.
        "shutdown_timeout_seconds": 2.0,
    }
    container = build(make_settings(database_url, outbox=outbox))
    container.clock.override(providers.Object(clock))  # units of work, pipeline, replay
    container.registry().register(ModelStepV1)
    refusing: set[str] = set()
    container.handlers().consume(CONSUMER, ModelStepV1, recording_handler(refusing))
    (consumer,) = [c for c in container.handlers().consumers if c.name == CONSUMER]
    bus = RecordingBus(container.bus())
    deliverer = OutboxDeliverer(
        registry=container.registry(),
        handlers=container.handlers(),
        dispatcher=container.dispatcher(),
        units=container.units_of_work(),
        bus=bus,
        breaker=container.breaker(),
    )
    settings_ = source_settings(container.settings(), container.database())
    # A separate loop: the async tests' session loop must not see these connections.
    with asyncio.Runner(loop_factory=asyncio.new_event_loop) as runner:
        world = World(
            runner=runner,
            container=container,
            clock=clock,
            bus=bus,
            deliverer=deliverer,
            consumer=consumer,
            refusing=refusing,
            source_settings=settings_,
            probe=Claimer(OUTBOX_TABLE, "event_name", batch=100, window=800),
        )
        engine = container.database().engine
        runner.run(create_effects_table(engine))
        try:
            yield world
        finally:
            runner.run(drop_effects_table(engine))
            runner.run(container.database().dispose())


async def create_effects_table(engine: AsyncEngine) -> None:
    async with engine.begin() as connection:
        await connection.run_sync(EFFECTS_METADATA.create_all)


async def drop_effects_table(engine: AsyncEngine) -> None:
    async with engine.begin() as connection:
        await connection.run_sync(EFFECTS_METADATA.drop_all)


# -- the model's side ---------------------------------------------------------------------------


@dataclass
class RowState:
    """One outbox row, as the model expects it or as the table holds it."""

    id: uuid.UUID
    seq: int
    label: str
    key: str | None
    state: str = PENDING
    retry_count: int = 0
    lock_token: uuid.UUID | None = None
    locked_until: datetime | None = None
    finished_on: datetime | None = None  # when it was stamped processed or dead-lettered
    was_dead_lettered: bool = False  # model only: exempt from the effect order (see docstring)

    def outcome(self) -> tuple[str, int, uuid.UUID | None, datetime | None, datetime | None]:
        """What the protocol's writes decide: compared between the table and the model."""
        return (self.state, self.retry_count, self.lock_token, self.locked_until, self.finished_on)

    # What each guarded write does to the row (the model calls them only for the current token).

    def lease(self, token: uuid.UUID, until: datetime) -> None:
        self.lock_token, self.locked_until = token, until

    def stamp(self, now: datetime) -> None:
        self.state, self.finished_on = PROCESSED, now
        self.lock_token = self.locked_until = None

    def back_off(self, attempt: int, until: datetime) -> None:
        """The row stays unclaimable, and its key blocked, until the backoff ends."""
        self.retry_count, self.lock_token, self.locked_until = attempt, None, until

    def dead_letter(self, attempt: int, now: datetime) -> None:
        self.state, self.retry_count, self.finished_on = DEAD, attempt, now
        self.lock_token = self.locked_until = None
        self.was_dead_lettered = True

    def release(self) -> None:
        self.lock_token = self.locked_until = None

    def return_to_pending(self) -> None:
        """A replay: retries reset, lease cleared."""
        self.state, self.retry_count, self.finished_on = PENDING, 0, None
        self.lock_token = self.locked_until = None

    def free(self, now: datetime) -> bool:
        """No live lease and no backoff: what the claim's ``free_and_due`` asks."""
        return self.locked_until is None or self.locked_until < now

    def in_flight(self, now: datetime) -> bool:
        return self.state == PENDING and self.lock_token is not None and not self.free(now)

    def __str__(self) -> str:
        return f"row {self.seq} ({self.label})"


Rows = Mapping[uuid.UUID, RowState]


def by_seq(rows: Rows) -> list[RowState]:
    return sorted(rows.values(), key=lambda row: row.seq)


def earlier_pending(rows: Rows, row: RowState) -> list[RowState]:
    return [r for r in by_seq(rows) if r.key == row.key and r.seq < row.seq and r.state == PENDING]


def earlier_dead_letters(rows: Rows, row: RowState) -> list[RowState]:
    return [r for r in by_seq(rows) if r.key == row.key and r.seq < row.seq and r.state == DEAD]


def mates_in_flight(rows: Rows, row: RowState, now: datetime) -> list[RowState]:
    return [r for r in by_seq(rows) if r.key == row.key and r.id != row.id and r.in_flight(now)]


def blocker(rows: Rows, row: RowState, now: datetime) -> str | None:
    """Why the claim may not take ``row`` now (None: it may)."""
    if row.state != PENDING:
        return f"it is {row.state}"
    if not row.free(now):
        return f"it is leased or backing off until {row.locked_until}"
    if row.key is None:
        return None
    if earlier := earlier_pending(rows, row):
        return f"{earlier[0]} of its key is still pending"
    if mates := mates_in_flight(rows, row, now):
        return f"{mates[0]} of its key is in flight"
    return None


def claimable(rows: Rows, now: datetime) -> list[uuid.UUID]:
    """Every row the claim may take now, oldest first."""
    return [row.id for row in by_seq(rows) if blocker(rows, row, now) is None]


def expected_claim(rows: Rows, now: datetime, batch: int) -> list[uuid.UUID]:
    """The rows a claim of ``batch`` takes: the oldest keyless rows and heads of keys, where the
    heads are cut to ``batch`` before those with a key-mate in flight are dropped (the claim
    statement's order of steps; see the module docstring)."""
    due = [row for row in by_seq(rows) if row.state == PENDING and row.free(now)]
    keyless = [row for row in due if row.key is None][:batch]
    heads = [row for row in due if row.key is not None and not earlier_pending(rows, row)][:batch]
    keyed = [row for row in heads if not mates_in_flight(rows, row, now)]
    return [row.id for row in sorted(keyless + keyed, key=lambda row: row.seq)[:batch]]


@dataclass
class CycleModel:
    """One processor's cycle as the model follows it; it exists while a delivery is held."""

    token: uuid.UUID
    rows: list[uuid.UUID]
    claimed_retries: dict[uuid.UUID, int]  # what the claim returned: failures count from there
    believed_until: dict[uuid.UUID, datetime]  # the lease end this processor last wrote
    position: int = 0
    completed: int = 0  # stamps that landed: what the cycle must report as progress

    @property
    def current(self) -> uuid.UUID:
        return self.rows[self.position]

    def unfinished(self) -> list[uuid.UUID]:
        return self.rows[self.position :]


@dataclass(frozen=True)
class Snapshot:
    """The tables after a step: the rows, the consumer's effects, what a claim would take."""

    rows: dict[uuid.UUID, RowState]
    effects: list[str]
    claimable: list[uuid.UUID] = field(default_factory=list)


def table_state(processed: datetime | None, dead: datetime | None) -> str:
    if processed is not None and dead is not None:
        return "processed and dead-lettered"
    if processed is not None:
        return PROCESSED
    return DEAD if dead is not None else PENDING


# -- the state machine --------------------------------------------------------------------------


class ProtocolModel(RuleBasedStateMachine):
    """The real processors and tables, and beside them the model of what the tables must hold."""

    def __init__(self, world: World) -> None:
        super().__init__()
        self.world = world
        self.clock = world.clock
        world.run(world.reset())
        self.processors = [world.processor(name) for name in PROCESSORS]
        self.rows: dict[uuid.UUID, RowState] = {}
        self.cycles: dict[str, CycleModel] = {}
        self.consumed: list[str] = []  # labels, in the order their one effect committed
        self.redelivered: set[str] = set()
        self.stale_writes: dict[uuid.UUID, str] = {}  # row -> a write a stale token tried (this step)
        self._version = 0
        self._cached: tuple[tuple[int, datetime], Snapshot] | None = None

    # -- plumbing ---------------------------------------------------------------------------

    def _act(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run a step's real code; the tables may change, so the snapshot is read again."""
        self._version += 1
        return self.world.run(coroutine)

    def _lease_end(self) -> datetime:
        return self.clock.now + timedelta(seconds=LEASE_SECONDS)

    def _choose(self, data: st.DataObject, names: list[str]) -> Processor:
        name = data.draw(st.sampled_from(names), label="processor")
        (processor,) = [p for p in self.processors if p.name == name]
        return processor

    def _idle(self) -> list[str]:
        return [p.name for p in self.processors if p.name not in self.cycles]

    def _holding(self) -> list[str]:
        return [p.name for p in self.processors if p.name in self.cycles]

    def _aged(self) -> list[str]:
        """Holders whose lease is shorter than a fresh one: a renewal would change something."""
        fresh = self._lease_end()
        held = [(name, self.cycles[name]) for name in self._holding()]
        return [name for name, cycle in held if cycle.believed_until[cycle.current] < fresh]

    def _mid_batch(self) -> list[str]:
        """Holders with rows not reached yet: a shutdown then has both kinds of row to release."""
        return [name for name in self._holding() if len(self.cycles[name].unfinished()) > 1]

    def _redeliverable(self) -> list[str]:
        sent = self.world.bus.sent
        return [r.label for r in by_seq(self.rows) if str(r.id) in sent and r.label not in self.redelivered]

    def _on_last_attempt(self, name: str) -> bool:
        cycle = self.cycles[name]
        return cycle.claimed_retries[cycle.current] + 1 >= MAX_RETRIES

    def _rows_in(self, state: str) -> list[RowState]:
        return [row for row in by_seq(self.rows) if row.state == state]

    def _by_label(self, label: str) -> RowState:
        (row,) = [row for row in self.rows.values() if row.label == label]
        return row

    async def _settle(self, processor: Processor) -> None:
        """Run until the processor's cycle holds its next delivery at the gate, or ends."""
        assert processor.cycle is not None
        arrival = asyncio.ensure_future(processor.deliverer.arrived.wait())
        try:
            async with asyncio.timeout(STEP_TIMEOUT_SECONDS):
                await asyncio.wait([processor.cycle, arrival], return_when=asyncio.FIRST_COMPLETED)
        finally:
            arrival.cancel()

    async def _start_cycle(self, processor: Processor) -> None:
        processor.deliverer.arrived.clear()
        processor.cycle = asyncio.create_task(processor.source.run_cycle())
        await self._settle(processor)

    async def _let_go(self, processor: Processor, held: Held, verdict: Verdict) -> None:
        processor.deliverer.arrived.clear()
        held.verdict.set_result(verdict)
        await self._settle(processor)

    async def _stop(self, processor: Processor) -> None:
        cycle = processor.cycle
        assert cycle is not None
        processor.cycle = None
        cycle.cancel()
        await asyncio.wait_for(asyncio.wait([cycle]), STEP_TIMEOUT_SECONDS)
        assert cycle.cancelled(), f"{processor.name}: the cycle swallowed its cancellation"

    async def _read(self) -> Snapshot:
        t = OUTBOX_TABLE.c
        columns = (t.id, t.seq, t.payload["label"].as_string().label("label"), t.ordering_key)
        outcome = (t.retry_count, t.lock_token, t.locked_until, t.processed_on, t.dead_lettered_on)
        now = self.clock.now
        async with self.world.container.database().engine.connect() as connection:
            found = (await connection.execute(sa.select(*columns, *outcome))).all()
            effects = await connection.execute(sa.select(EFFECTS.c.label).order_by(EFFECTS.c.id))
            labels = [str(label) for (label,) in effects]
            probed = await self.world.probe.claim(
                connection, now=now, lease_until=now, token=uuid.uuid4(), locked_by="model-probe"
            )
            await connection.rollback()  # only a look at what the claim would take
        rows = {
            r.id: RowState(
                r.id,
                r.seq,
                r.label,
                r.ordering_key,
                table_state(r.processed_on, r.dead_lettered_on),
                r.retry_count,
                r.lock_token,
                r.locked_until,
                r.processed_on or r.dead_lettered_on,
            )
            for r in found
        }
        return Snapshot(rows, labels, [row.id for row in probed])

    def _snapshot(self) -> Snapshot:
        key = (self._version, self.clock.now)
        if self._cached is None or self._cached[0] != key:
            self._cached = (key, self.world.run(self._read()))
        return self._cached[1]

    # -- what the model does for each real step -----------------------------------------------

    def _claim(self, processor: Processor) -> None:
        now = self.clock.now
        expected = expected_claim(self.rows, now, BATCH_SIZE)
        self._act(self._start_cycle(processor))
        assert processor.source.last_claim is not None
        token, claimed = processor.source.last_claim
        taken = [row.id for row in claimed]
        assert taken == expected, self._explain_claim(processor.name, taken, expected)
        until = now + timedelta(seconds=LEASE_SECONDS)
        for row_id in taken:
            self.rows[row_id].lease(token, until)
        self.cycles[processor.name] = CycleModel(
            token,
            taken,
            {row_id: self.rows[row_id].retry_count for row_id in taken},
            dict.fromkeys(taken, until),
        )
        self._follow(processor)

    def _explain_claim(self, name: str, taken: list[uuid.UUID], expected: list[uuid.UUID]) -> str:
        now = self.clock.now
        taken_seqs, expected_seqs = [self.rows[i].seq for i in taken], [self.rows[i].seq for i in expected]
        lines = [f"{name} claimed rows {taken_seqs}, the model expected {expected_seqs}"]
        lines += [
            f"  {self.rows[row_id]} was taken although {why}"
            for row_id in taken
            if row_id not in expected and (why := blocker(self.rows, self.rows[row_id], now))
        ]
        for row_id in expected:
            row = self.rows[row_id]
            dead = earlier_dead_letters(self.rows, row)
            if row_id not in taken and row.key is not None and dead:
                lines.append(f"  {row} was left although only dead letters ({dead[0]}) precede it")
        return "\n".join(lines)

    def _follow(self, processor: Processor) -> None:
        """Advance the model's cycle to its next delivery (a renewal that lands), or end it;
        the real cycle must be in the same place."""
        cycle = self.cycles[processor.name]
        while cycle.position < len(cycle.rows):
            row = self.rows[cycle.current]
            if row.lock_token == cycle.token:  # the renewal before dispatch lands
                row.locked_until = cycle.believed_until[row.id] = self._lease_end()
                break
            cycle.position += 1  # lost before dispatch: skipped, nothing written
        self.no_outcome_by_a_stale_token()  # before the cycle's own report: the clearer message
        held = processor.deliverer.held
        if cycle.position < len(cycle.rows):
            expected = self.rows[cycle.current]
            actual = "nothing" if held is None else str(self.rows[held.row.id])
            assert held is not None, f"{processor.name} should be delivering {expected}, but delivers nothing"
            assert held.row.id == expected.id, (
                f"{processor.name} should be delivering {expected}, not {actual}"
            )
            return
        assert held is None, f"{processor.name} delivers {self.rows[held.row.id]} after its cycle should end"
        task = processor.cycle
        assert task is not None
        assert task.done(), f"{processor.name}'s cycle should have ended"
        result = task.result()
        assert (result.claimed, result.completed) == (len(cycle.rows), cycle.completed), (
            f"{processor.name} reported {result}; the model counts {len(cycle.rows)} claimed, "
            f"{cycle.completed} stamped"
        )
        processor.cycle = None
        del self.cycles[processor.name]

    def _stamp(self, name: str, cycle: CycleModel, row: RowState) -> None:
        if row.lock_token != cycle.token:
            self.stale_writes[row.id] = f"{name}'s stamp"
            return
        row.stamp(self.clock.now)
        cycle.completed += 1

    def _charge(self, name: str, cycle: CycleModel, row: RowState) -> None:
        if row.lock_token != cycle.token:
            self.stale_writes[row.id] = f"{name}'s failure record"
            return
        attempt = cycle.claimed_retries[row.id] + 1
        if attempt >= MAX_RETRIES:
            row.dead_letter(attempt, self.clock.now)
        else:
            row.back_off(attempt, self.clock.now + backoff(attempt))

    def _resolve(self, processor: Processor, verdict: Verdict) -> None:
        cycle = self.cycles[processor.name]
        row = self.rows[cycle.current]
        held = processor.deliverer.held
        assert held is not None
        if verdict is Verdict.REFUSE and row.label not in self.consumed:
            self._charge(processor.name, cycle, row)
        else:  # consumed now, or skipped by the inbox as a duplicate: the publish succeeded
            if row.label not in self.consumed:
                self.consumed.append(row.label)
            self._stamp(processor.name, cycle, row)
        cycle.position += 1
        self._act(self._let_go(processor, held, verdict))
        self._follow(processor)

    def _shutdown(self, processor: Processor) -> None:
        cycle = self.cycles.pop(processor.name)
        for row_id in cycle.rows:  # every row of the batch, reached or not; none is charged
            row = self.rows[row_id]
            if row.lock_token == cycle.token:
                row.release()
            elif row_id in cycle.unfinished():
                self.stale_writes[row_id] = f"{processor.name}'s shutdown release"
        self._act(self._stop(processor))

    async def _enqueue(self, key: str | None, label: str) -> RowState:
        event = ModelStepV1(aggregate_id=key, label=label, occurred_on=self.clock.now)
        async with self.world.container.units_of_work()() as uow:
            uow.enqueue(event)
            await uow.commit()
        t = OUTBOX_TABLE.c
        async with self.world.container.database().engine.connect() as connection:
            written = await connection.execute(
                sa.select(t.id, t.seq, t.ordering_key).where(t.payload["label"].as_string() == label)
            )
            row = written.one()
        return RowState(row.id, row.seq, label, row.ordering_key)

    # -- rules --------------------------------------------------------------------------------

    @initialize(keys=st.lists(st.sampled_from(KEYS), min_size=3, max_size=MAX_BACKLOG), outage=st.booleans())
    def backlog(self, keys: list[str | None], outage: bool) -> None:
        """A run starts with a few messages written. After an ``outage`` of their consumer, every
        row that could be claimed has failed once already: one more failure dead-letters it, so
        the deeper states (a replay while a key-mate is in flight) are a few steps away."""
        for key in keys:
            self.enqueue(key)
        first = self.processors[0]
        while outage and claimable(self.rows, self.clock.now):
            self._claim(first)
            while first.name in self.cycles:
                self._resolve(first, Verdict.REFUSE)
        if outage:
            self.clock.advance(PAST_A_BACKOFF_SECONDS)

    @precondition(lambda self: len(self._rows_in(PENDING)) < MAX_BACKLOG)
    @rule(key=st.sampled_from(KEYS))
    def enqueue(self, key: str | None) -> None:
        """A unit of work commits a message (the outbox row is written in its transaction)."""
        row = self._act(self._enqueue(key, f"{key or 'keyless'}-{len(self.rows) + 1}"))
        self.rows[row.id] = row

    # Only when the model sees a claimable row: an empty claim spends a step and proves little
    # (a claim that takes what it must not is caught whenever it runs).
    @precondition(lambda self: bool(self._idle()) and bool(claimable(self.rows, self.clock.now)))
    @rule(data=st.data())
    def claim(self, data: st.DataObject) -> None:
        """An idle processor starts a cycle: the claim, then the renewal before its first row."""
        self._claim(self._choose(data, self._idle()))

    @precondition(lambda self: bool(self._aged()))
    @rule(data=st.data())
    def renew(self, data: st.DataObject) -> None:
        """A processor renews the lease of the row it is delivering (after time passed)."""
        processor = self._choose(data, self._aged())
        cycle = self.cycles[processor.name]
        row = self.rows[cycle.current]
        held = processor.deliverer.held
        assert held is not None
        renewed = self._act(processor.source.outcomes.renew(held.row, held.token))
        ours = row.lock_token == cycle.token
        assert renewed == ours, (
            f"{processor.name} renewed {row} with a token it no longer holds"
            if renewed
            else f"{processor.name} could not renew {row} although it holds its token"
        )
        if ours:
            row.locked_until = cycle.believed_until[row.id] = self._lease_end()

    @precondition(lambda self: bool(self._holding()))
    @rule(data=st.data())
    def consume(self, data: st.DataObject) -> None:
        """The held delivery goes through: published, consumed (or skipped as a duplicate), stamped."""
        self._resolve(self._choose(data, self._holding()), Verdict.DELIVER)

    @precondition(lambda self: any(not self._on_last_attempt(name) for name in self._holding()))
    @rule(data=st.data())
    def fail(self, data: st.DataObject) -> None:
        """The consumer's handler raises: the effect rolls back, a retry is charged, it backs off."""
        names = [name for name in self._holding() if not self._on_last_attempt(name)]
        self._resolve(self._choose(data, names), Verdict.REFUSE)

    @precondition(lambda self: any(self._on_last_attempt(name) for name in self._holding()))
    @rule(data=st.data())
    def dead_letter(self, data: st.DataObject) -> None:
        """The consumer's handler raises on the row's last attempt: the row is dead-lettered."""
        names = [name for name in self._holding() if self._on_last_attempt(name)]
        self._resolve(self._choose(data, names), Verdict.REFUSE)

    @rule()  # always possible: a run never runs out of steps
    def expire(self) -> None:
        """Time passes on the clock every processor reads, past the end of every lease."""
        self.clock.advance(PAST_EVERY_LEASE_SECONDS)

    @precondition(lambda self: any(row.locked_until is not None for row in self._rows_in(PENDING)))
    @rule()
    def time_passes(self) -> None:
        """Time passes past a backoff, not past a lease just renewed."""
        self.clock.advance(PAST_A_BACKOFF_SECONDS)

    @precondition(lambda self: bool(self._rows_in(DEAD)))
    @rule(data=st.data())
    def replay(self, data: st.DataObject) -> None:
        """The operator returns a dead letter to the pending pool."""
        labels = [row.label for row in self._rows_in(DEAD)]
        self._replay(self._by_label(data.draw(st.sampled_from(labels), label="dead letter")))

    def _replay(self, row: RowState) -> None:
        result = self._act(self.world.container.admin().replay("outbox", [str(row.id)], actor="model"))
        assert result.replayed == [str(row.id)], f"replaying {row} gave {result}"
        row.return_to_pending()

    @precondition(lambda self: bool(self._redeliverable()))
    @rule(data=st.data())
    def redeliver(self, data: st.DataObject) -> None:
        """The broker hands a message it was given to the consumer once more (once a message)."""
        row = self._by_label(data.draw(st.sampled_from(self._redeliverable()), label="message"))
        self.redelivered.add(row.label)
        envelope = self.world.bus.sent[str(row.id)]
        headers = self.world.container.signer().sign(envelope.headers(), envelope.body)
        pipeline = self.world.container.pipeline()
        outcome = self._act(pipeline.consume(self.world.consumer, headers, envelope.body))
        expected = ConsumeOutcome.DUPLICATE if row.label in self.consumed else ConsumeOutcome.CONSUMED
        assert outcome is expected, f"redelivering {row}: {outcome}, the model expected {expected}"
        if outcome is ConsumeOutcome.CONSUMED:
            self.consumed.append(row.label)

    @precondition(lambda self: bool(self._mid_batch()))
    @rule(data=st.data())
    def shutdown(self, data: st.DataObject) -> None:
        """A processor stops mid-cycle: its rows are released at once, none is charged."""
        self._shutdown(self._choose(data, self._mid_batch()))

    # -- invariants -----------------------------------------------------------------------------

    @invariant()
    def no_row_is_lost(self) -> None:
        """Every row written is still there, in one state; a processed row reached its consumer."""
        snapshot = self._snapshot()
        missing = [str(self.rows[i]) for i in self.rows.keys() - snapshot.rows.keys()]
        unknown = [str(snapshot.rows[i]) for i in snapshot.rows.keys() - self.rows.keys()]
        assert not missing, f"rows vanished from the outbox: {missing}"
        assert not unknown, f"rows the model never wrote: {unknown}"
        states = {PENDING, PROCESSED, DEAD}
        odd = [f"{row}: {row.state}" for row in snapshot.rows.values() if row.state not in states]
        assert not odd, f"rows in no single state: {odd}"
        received = set(snapshot.effects)
        unreached = [
            str(r) for r in snapshot.rows.values() if r.state == PROCESSED and r.label not in received
        ]
        assert not unreached, f"stamped processed, yet their consumer never took them: {unreached}"

    @invariant()
    def no_outcome_by_a_stale_token(self) -> None:
        """The table holds exactly the outcomes written under the row's current token."""
        snapshot = self._snapshot()
        for row_id, expected in self.rows.items():
            actual = snapshot.rows.get(row_id)
            if actual is None or actual.outcome() == expected.outcome():
                continue
            where = f"{expected}: the table holds {actual.outcome()}, the model {expected.outcome()}"
            stale = self.stale_writes.get(row_id)
            assert stale is None, f"{stale} landed although another token held the row ({where})"
            msg = f"the table and the model disagree on {where}"
            raise AssertionError(msg)
        self.stale_writes.clear()  # refused, as they must be

    @invariant()
    def at_most_one_live_lease_per_row(self) -> None:
        """Within its lease a processor is its row's only holder; a key has one row in flight."""
        now = self.clock.now
        holders: dict[uuid.UUID, list[str]] = defaultdict(list)
        for name, cycle in self.cycles.items():
            for row_id in cycle.unfinished():
                if cycle.believed_until[row_id] >= now:
                    holders[row_id].append(name)
        doubled = {str(self.rows[i]): names for i, names in holders.items() if len(names) > 1}
        assert not doubled, f"rows held by two processors, each within its lease: {doubled}"
        by_key = Counter(self.rows[i].key for i in holders if self.rows[i].key is not None)
        assert all(n == 1 for n in by_key.values()), f"keys with two rows in flight: {by_key}"
        in_flight = Counter(r.key for r in self._snapshot().rows.values() if r.key and r.in_flight(now))
        assert all(n == 1 for n in in_flight.values()), f"keys with two live leases in the table: {in_flight}"

    @invariant()
    def per_key_order(self) -> None:
        """The claim takes only heads of keys; a key's effects come in the order of its rows."""
        snapshot = self._snapshot()
        for row_id in snapshot.claimable:
            row = snapshot.rows[row_id]
            earlier = earlier_pending(snapshot.rows, row) if row.key is not None else []
            assert not earlier, f"the claim would take {row} ahead of pending {earlier[0]}"
        keys = Counter(snapshot.rows[i].key for i in snapshot.claimable if snapshot.rows[i].key is not None)
        assert all(n == 1 for n in keys.values()), f"the claim would take two rows of a key: {keys}"
        order: dict[str, list[RowState]] = defaultdict(list)
        for label in snapshot.effects:
            row = self._by_label(label)
            if row.key is not None and not row.was_dead_lettered:
                order[row.key].append(row)
        for key, rows in order.items():
            seqs = [row.seq for row in rows]
            assert seqs == sorted(seqs), f"key {key}: effects in the order {seqs}"

    @invariant()
    def dead_letters_release_their_key(self) -> None:
        """A free head behind dead letters is claimable; the claim agrees with the model."""
        snapshot = self._snapshot()
        now = self.clock.now
        for row in by_seq(snapshot.rows):
            behind = earlier_dead_letters(snapshot.rows, row)
            if row.key is None or not behind or blocker(snapshot.rows, row, now) is not None:
                continue
            assert row.id in snapshot.claimable, (
                f"{row} is free and only finished rows precede it, yet the claim would not take it: "
                f"the dead letter {behind[-1]} still blocks key {row.key}"
            )
        expected = claimable(self.rows, now)
        assert snapshot.claimable == expected, (
            f"the claim would take {[snapshot.rows[i].seq for i in snapshot.claimable]}, "
            f"the model allows {[self.rows[i].seq for i in expected]}"
        )

    @invariant()
    def exactly_one_effect_per_message(self) -> None:
        """Redeliveries and late deliveries are skipped by the inbox; a refused one rolled back."""
        effects = self._snapshot().effects
        twice = sorted(label for label, n in Counter(effects).items() if n > 1)
        assert not twice, f"messages whose consumer's effect committed twice: {twice}"
        assert effects == self.consumed, f"effects {effects}, the model expected {self.consumed}"

    def _check_invariants(self) -> None:
        self.no_row_is_lost()
        self.no_outcome_by_a_stale_token()
        self.at_most_one_live_lease_per_row()
        self.per_key_order()
        self.dead_letters_release_their_key()
        self.exactly_one_effect_per_message()

    # -- the end of a run ---------------------------------------------------------------------

    def teardown(self) -> None:
        try:
            # After a failed step that failure is the report; a drain would bury it under another.
            if sys.exc_info()[1] is None:
                self._drain_and_check()
        finally:
            self.world.run(self._abandon_cycles())

    def _drain_and_check(self) -> None:
        """Stop every processor, deliver everything, replay the dead letters once, deliver them:
        every message must then have been consumed exactly once."""
        for processor in self.processors:
            if processor.name in self.cycles:
                self._shutdown(processor)
        self._drain()
        for row in self._rows_in(DEAD):
            self._replay(row)
        self._drain()
        self._check_invariants()
        left = [str(row) for row in by_seq(self.rows) if row.state != PROCESSED]
        assert not left, f"not delivered after draining: {left}"
        assert sorted(self.consumed) == sorted(row.label for row in self.rows.values())

    def _drain(self) -> None:
        drainer = self.processors[0]
        for _ in range(len(self.rows) + 1):  # every round delivers at least the head of one key
            if not self._rows_in(PENDING):
                return
            self.clock.advance(LEASE_SECONDS + 1)  # every lease and backoff is over
            self._claim(drainer)
            while drainer.name in self.cycles:
                self._resolve(drainer, Verdict.DELIVER)
            self._check_invariants()
        msg = f"still pending after draining: {[str(r) for r in self._rows_in(PENDING)]}"
        raise AssertionError(msg)

    async def _abandon_cycles(self) -> None:
        """Whatever a failed run left running must not outlive it (the loop is shared)."""
        for processor in self.processors:
            if processor.cycle is not None:
                processor.cycle.cancel()
                await asyncio.wait([processor.cycle])
                processor.cycle = None


def bound_to(world: World) -> type[ProtocolModel]:
    class RelayProtocol(ProtocolModel):
        """The model on this test's world (Hypothesis builds each run's machine with no arguments)."""

        def __init__(self) -> None:
            super().__init__(world)

    return RelayProtocol


@pytest.mark.reliability
@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.timeout(900)  # a failure is shrunk for up to 300 s (Hypothesis's limit) after it is found
def test_the_relay_protocol_keeps_its_invariants(
    postgres_url: str, container_builder: ContainerBuilder
) -> None:
    with open_world(container_builder, postgres_url) as world:
        run_state_machine_as_test(bound_to(world), settings=SETTINGS)
