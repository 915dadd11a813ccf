"""The OS processes of the reliability tier (``outbox_kit.testing.reliability``), and how a
scenario starts, injures and reads them.

Every process builds the service's own container: the suite's ``container_builder`` fixture, named
to the process by ``OUTBOX_KIT_TEST_CONTAINER`` (``module:function``, see :func:`builder_path`),
so a generated service's reliability tier runs its own settings, contexts and wiring, and the
kit's suite the kit's. ``python -m outbox_kit.testing.processes <role> ...`` runs one:

* ``worker``: the service's ``worker`` command (``run_worker``: processors, consumers, the LISTEN
  connection, SIGTERM handling) on the real database and broker, with the test kit registered and
  one consumer (``LEDGER``), whose handler writes what it saw (label, tenant, user, roles,
  correlation) into ``kit_received`` in the handler's own transaction: an effect, exactly as a
  user's handler would have one, so a duplicate effect or a lost message shows in that table.
  Faults are injected at seams the service owns, never by changing its code:
  ``--crash-after-publish N`` ends the process (``os._exit``, no cleanup) right after the N-th
  publish the broker confirmed, before the processed stamp; ``--poison-file PATH`` makes the
  publish of every event valued ``RELAY_POISON`` fail while that file exists (a bug that a later
  deploy fixes). ``--status PATH`` receives the process's counters (claims and the service's own
  metrics) every 200 ms, so a scenario can tell a paused relay from a spinning one.
* ``service ...``: the service's command line (``outbox_kit.runtime.cli``: ``worker``, ``api``,
  ``outbox``...) on that container, for the tests of the commands themselves.
* ``processor``, ``consumer``, ``crasher``, ``broker-racer``: one part of the relay or the
  consume pipeline alone, recording what it did in the kit's ``kit_deliveries`` table, in its own
  committed transaction, before it reports success: so a duplicate delivery, a lost row or an
  order violation is visible after the fact.

The conformance scenarios write events through the real unit of work (each commit under its own
tenant, user, roles and correlation), run a :class:`Fleet` of worker processes against the real
database and broker, injure them (SIGKILL, SIGTERM, a cut line, a crash between publish and
stamp), and then :func:`check_delivery` proves the guarantee from the tables alone: every event
reached the consumer's handler exactly once (its effect row commits with the inbox row), under
the context it was written with. The figures of every scenario go to :data:`REPORT`, printed as a
table at the end of the run and written to ``reliability-report.md``.

A scenario writes events through the real unit of work (each commit under its own tenant, user,
roles and correlation), runs a :class:`Fleet` of real worker processes against the real database
and broker, injures them (SIGKILL, SIGTERM, a cut line, a crash between publish and stamp), and
then :func:`check_delivery` proves the guarantee from the tables alone: every event reached the
consumer's handler exactly once (its effect row commits with the inbox row), under the context it
was written with. The figures of every scenario go to :data:`REPORT`, printed as a table at the
end of the run and written to ``reliability-report.md``.

Processes are reaped by :meth:`Fleet.reap` (a fixture finalizer), also when a scenario fails.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextvars
import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from dependency_injector import providers

from outbox_kit.application.clock import TimeLimit, system_clock
from outbox_kit.application.context import (
    CapturedContext,
    RequestContext,
    current_context,
    use_context,
)
from outbox_kit.application.handlers import Consumer
from outbox_kit.application.tracing import SpanKind
from outbox_kit.application.unit_of_work import UnitOfWork
from outbox_kit.consume.inbox import ConsumeOutcome, ConsumePipeline
from outbox_kit.persistence.tables import (
    OUTBOX_TABLE,
)
from outbox_kit.persistence.unit_of_work import SqlUnitOfWork
from outbox_kit.persistence.writer import WakeSignal
from outbox_kit.processor.claim import ClaimedRow
from outbox_kit.processor.cycle import (
    TableSource,
)
from outbox_kit.processor.processor import (
    Processor,
    RowByRow,
    SourceSettings,
)
from outbox_kit.runtime import cli
from outbox_kit.runtime.container import OutboxContainer, build_listeners, source_settings
from outbox_kit.runtime.server import run_worker
from outbox_kit.runtime.settings import ServiceSettings
from outbox_kit.testing.fixtures import (
    CONTAINER_VARIABLE,
    SERVICE_URLS,
    ContainerBuilder,
    acting_as,
    builder_path,
    fetch,
    kit_container,
    longest_delivery,
    make_settings,
    service_container,
)
from outbox_kit.testing.harness import (
    CONSUMER,
    DELIVERIES,
    RECEIVED,
    Counter,
    CounterChangedV1,
    Counters,
    Noted,
    install_kit,
    record_effect,
    register_kit,
)
from outbox_kit.transports.bus import Delivered, Unrouted
from outbox_kit.transports.envelope import (
    Envelope,
)

REPORT: list[dict[str, Any]] = []
DUPLICATE_LINE = "skipped duplicate message"  # the inbox's log line for a copy it did not run
# What lets a worker started with ``--wait-for-cue`` begin (SIGUSR1 asks a worker for its stacks).
CUE = signal.SIGUSR2
READY_FOR_THE_CUE = "ready for the cue"


def sql(uow: UnitOfWork) -> SqlUnitOfWork:
    """A handler's unit of work as the SQL one these processes always run (its session)."""
    assert isinstance(uow, SqlUnitOfWork)
    return uow


def process_environment(build: ContainerBuilder) -> dict[str, str]:
    """A test process's environment: no service settings leak in from the test's, and
    ``OUTBOX_KIT_TEST_CONTAINER`` names the builder."""
    env = {k: v for k, v in os.environ.items() if "__" not in k}
    return env | {CONTAINER_VARIABLE: builder_path(build)}


def cycling(keys: int) -> Callable[[int], str | None]:
    """Ordering keys ``key-0`` .. ``key-{keys-1}``, in turn."""
    return lambda index: f"key-{index % keys}"


@dataclass(frozen=True)
class Sent:
    """One event a scenario wrote, with the context it was written under."""

    label: str
    key: str | None
    value: int
    tenant: str
    user: str
    roles: str
    correlation: str


async def write_events(
    container: OutboxContainer,
    count: int,
    *,
    key_of: Callable[[int], str | None] = lambda _: None,
    tenants: int = 7,
    per_commit: int = 10,
    first: int = 0,
    values: Callable[[int], int] = lambda index: index,
) -> list[Sent]:
    """``count`` events in commits of ``per_commit``, each commit under another caller (tenant,
    user, roles and correlation cycle independently, so rows of many tenants interleave)."""
    sent: list[Sent] = []
    units = container.units_of_work()
    for start in range(first, first + count, per_commit):
        commit = start // per_commit
        roles = ("clerk",) if commit % 2 else ("clerk", "auditor")
        caller = {
            "tenant": f"tenant-{commit % tenants}",
            "user": f"user-{commit % 5}",
            "roles": roles,
            "correlation_id": f"corr-{commit}",
        }
        with acting_as(**caller):  # type: ignore[arg-type]
            async with units() as uow:
                for index in range(start, min(start + per_commit, first + count)):
                    key = key_of(index)
                    event = CounterChangedV1(
                        counter_id=f"event-{index}", value=values(index), aggregate_id=key
                    )
                    uow.enqueue(event)
                    sent.append(
                        Sent(
                            event.counter_id,
                            key,
                            event.value,
                            caller["tenant"],  # type: ignore[arg-type]
                            caller["user"],  # type: ignore[arg-type]
                            ",".join(roles),
                            caller["correlation_id"],  # type: ignore[arg-type]
                        )
                    )
                await uow.commit()
    return sent


@dataclass
class Worker:
    name: str
    process: subprocess.Popen[bytes]
    log: Path
    status: Path


@dataclass
class Fleet:
    """Worker processes of the service on one database, broker and namespace."""

    folder: Path
    build: ContainerBuilder
    database_url: str
    transport: str
    broker_url: str
    namespace: str
    options: tuple[str, ...] = ()
    workers: dict[str, Worker] = field(default_factory=dict)
    retired: list[Worker] = field(default_factory=list)
    kills: int = 0

    def start(self, name: str, *options: str) -> Worker:
        log, status = self.folder / f"{name}.{len(self.retired)}.log", self.folder / f"{name}.json"
        status.unlink(missing_ok=True)
        env = process_environment(self.build)
        command = [
            sys.executable,
            "-m",
            "outbox_kit.testing.processes",
            "worker",
            *("--db", self.database_url, "--transport", self.transport, "--url", self.broker_url),
            *("--namespace", self.namespace, "--name", name, "--status", str(status)),
            *self.options,
            *options,
        ]
        with log.open("wb") as output:
            process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)
        worker = Worker(name, process, log, status)
        self.workers[name] = worker
        return worker

    async def started(self, name: str, timeout: float = 60) -> None:
        """Wait until the worker logged that its processors and consumers run."""
        await self.said(name, "worker started", timeout)

    async def said(self, name: str, text: str, timeout: float = 60, *, anew: bool = False) -> None:
        """Wait until the process's output contains ``text`` (``anew``: once more than now)."""
        worker = self.workers[name]
        deadline = time.monotonic() + timeout
        seen = worker.log.read_text(errors="replace").count(text) if anew else 0
        while worker.log.read_text(errors="replace").count(text) <= seen:
            if worker.process.poll() is not None or time.monotonic() > deadline:
                msg = f"{name} never said {text!r} (exit {worker.process.returncode}):\n{self.tail(worker)}"
                raise AssertionError(msg)
            await asyncio.sleep(0.02)

    def cue(self, name: str) -> None:
        """Let a worker started with ``--wait-for-cue`` begin its work (once it said
        :data:`READY_FOR_THE_CUE`)."""
        self.workers[name].process.send_signal(CUE)

    def kill(self, name: str) -> None:
        worker = self.workers.pop(name)
        worker.process.send_signal(signal.SIGKILL)
        worker.process.wait(10)
        self.retired.append(worker)
        self.kills += 1

    def freeze(self, name: str) -> None:
        """SIGSTOP: the process holds its leases and does nothing (a stalled VM, a long pause)."""
        self.workers[name].process.send_signal(signal.SIGSTOP)

    def thaw(self, name: str) -> None:
        self.workers[name].process.send_signal(signal.SIGCONT)

    async def terminate(self, name: str, timeout: float = 30) -> tuple[int, float]:
        """SIGTERM, then wait for the exit: (exit status, seconds it took)."""
        worker = self.workers.pop(name)
        began = time.monotonic()
        worker.process.send_signal(signal.SIGTERM)
        while worker.process.poll() is None:
            if time.monotonic() - began > timeout:
                worker.process.kill()
                msg = f"{name} ignored SIGTERM for {timeout} s:\n{self.tail(worker)}"
                raise AssertionError(msg)
            await asyncio.sleep(0.05)
        self.retired.append(worker)
        return worker.process.returncode, time.monotonic() - began

    async def exited(self, name: str, timeout: float = 60) -> int:
        worker = self.workers[name]
        deadline = time.monotonic() + timeout
        while worker.process.poll() is None:
            if time.monotonic() > deadline:
                msg = f"{name} is still running after {timeout} s"
                raise AssertionError(msg)
            await asyncio.sleep(0.05)
        self.retired.append(self.workers.pop(name))
        return worker.process.returncode

    async def stop_all(self) -> None:
        """SIGTERM every worker and expect a clean exit. A worker restarted a moment ago is let
        finish starting first: it installs its SIGTERM handling last (a fast drain can end
        while one is still importing)."""
        for name in list(self.workers):
            if self.workers[name].process.poll() is None:
                await self.started(name)
            code, _ = await self.terminate(name)
            assert code == 0, f"{name} exited {code}:\n{self.tail(self.retired[-1])}"

    def reap(self) -> None:
        """Kill whatever still runs (a failed scenario must not leave workers behind), after
        asking each for its tasks' stacks (SIGUSR1, into its log) for the post-mortem."""
        running = [w for w in self.workers.values() if w.process.poll() is None]
        for worker in running:
            worker.process.send_signal(signal.SIGUSR1)
        if running:
            time.sleep(0.5)
        for worker in running:
            worker.process.kill()
            worker.process.wait(10)
        self.retired.extend(self.workers.values())
        self.workers.clear()

    def status(self, name: str) -> dict[str, float]:
        """The process's latest figures (its last ones once it has stopped)."""
        path = self.folder / f"{name}.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def logs(self) -> str:
        every = [*self.retired, *self.workers.values()]
        return "\n".join(w.log.read_text(errors="replace") for w in every if w.log.exists())

    def duplicates(self) -> int:
        """Copies the broker carried that the inbox recognised and did not run again."""
        return self.logs().count(DUPLICATE_LINE)

    @staticmethod
    def tail(worker: Worker) -> str:
        return worker.log.read_text(errors="replace")[-4000:] if worker.log.exists() else ""


async def never_runs(event: CounterChangedV1, uow: UnitOfWork) -> None:
    del event, uow  # the test process only declares the consumer's queue; workers consume


@asynccontextmanager
async def declared_topology(
    build: ContainerBuilder,
    database_url: str,
    namespace: str,
    consumer: str,
    bus_settings: dict[str, Any],
    *,
    fresh_tables: bool = False,
) -> AsyncIterator[OutboxContainer]:
    """A container on ``namespace`` whose started bus has declared ``consumer``'s queue or
    stream (its handler never runs here: worker processes consume), so nothing a worker
    publishes is unroutable; the topology is deleted afterwards, messages included.
    ``fresh_tables`` (re)creates and empties the kit's tables."""
    container = build(
        make_settings(database_url, application={"namespace": namespace}, message_bus=bus_settings)
    )
    await install_kit(container, create_tables=fresh_tables)
    container.handlers().consume(consumer, CounterChangedV1, never_runs)
    bus = container.bus()
    await bus.start()
    try:
        yield container
    finally:
        await bus.stop()
        await bus.delete_topology()  # type: ignore[attr-defined]
        await container.database().dispose()


async def received(container: OutboxContainer) -> list[Any]:
    return await fetch(container, sa.select(RECEIVED).order_by(RECEIVED.c.id))


async def outbox_rows(container: OutboxContainer) -> list[Any]:
    return await fetch(container, sa.select(OUTBOX_TABLE).order_by(OUTBOX_TABLE.c.seq))


async def wait_until(check: Callable[[], Awaitable[bool]], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            msg = f"not within {timeout} s: {what}"
            raise AssertionError(msg)
        await asyncio.sleep(0.25)


async def all_received(container: OutboxContainer, sent: list[Sent], timeout: float) -> None:
    labels = {s.label for s in sent}

    async def complete() -> bool:
        seen = {row.label for row in await received(container)}
        return labels <= seen

    await wait_until(complete, timeout, f"all {len(labels)} events reached the consumer")


@dataclass
class Delivery:
    """What one scenario measured: the table's row."""

    scenario: str
    transport: str
    events: int
    lost: int
    duplicated_effects: int
    wrong_context: int
    broker_redeliveries: int
    seconds: float
    notes: str = ""


async def check_delivery(
    container: OutboxContainer,
    sent: list[Sent],
    fleet: Fleet,
    *,
    scenario: str,
    began: float,
    notes: str = "",
) -> Delivery:
    """Every event handled exactly once, under its own caller; the outbox holds no pending row.
    Records the scenario's figures in :data:`REPORT` (also when an assertion then fails)."""
    effects = await received(container)
    runs = collections.Counter(row.label for row in effects)
    by_label = {s.label: s for s in sent}

    def caller_of(label: str) -> tuple[str, ...]:
        s = by_label[label]
        return (s.tenant, s.user, s.roles, s.correlation)

    wrong = [
        row.label
        for row in effects
        if row.label in by_label
        and (row.tenant_id, row.user_id, row.roles, row.correlation_id) != caller_of(row.label)
    ]
    delivery = Delivery(
        scenario=scenario,
        transport=fleet.transport,
        events=len(sent),
        lost=sum(1 for s in sent if runs[s.label] == 0),
        duplicated_effects=sum(n - 1 for n in runs.values() if n > 1),
        wrong_context=len(wrong),
        broker_redeliveries=fleet.duplicates(),
        seconds=round(time.monotonic() - began, 1),
        notes=notes,
    )
    REPORT.append(delivery.__dict__)
    assert delivery.lost == 0, f"{delivery.lost} events never reached the handler"
    assert delivery.duplicated_effects == 0, [label for label, n in runs.items() if n > 1][:20]
    assert wrong == [], f"handlers ran under another caller's context: {wrong[:20]}"
    assert set(runs) <= set(by_label), "the handler saw an event nobody wrote"
    pending = [
        r for r in await outbox_rows(container) if r.processed_on is None and r.dead_lettered_on is None
    ]
    assert pending == [], f"{len(pending)} outbox rows still pending"
    return delivery


def assert_keys_flowed_in_order(rows: list[Any], effects: list[Any]) -> None:
    """Per ordering key: rows finished in ``seq`` order, and no row's message reached the consumer
    before every earlier row of its key was finished (processed or dead-lettered): the relay
    published a key's next row only after the previous one was done, on every worker."""
    finished_by_key: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for row in rows:
        done = row.processed_on or row.dead_lettered_on
        if row.ordering_key is not None and done is not None:
            finished_by_key[row.ordering_key].append((row.seq, done.timestamp()))
    first_seen: dict[str, float] = {}
    for effect in effects:
        first_seen.setdefault(effect.label, effect.received_at)
    seq_of = {row.payload["counter_id"]: row.seq for row in rows}
    for key, finished in finished_by_key.items():
        times = [t for _, t in sorted(finished)]
        assert times == sorted(times), f"key {key}: rows finished out of seq order"
    for effect in effects:
        key = effect.ordering_key
        if key is None or first_seen[effect.label] != effect.received_at:
            continue
        seq = seq_of[effect.label]
        for earlier_seq, done in finished_by_key[key]:
            if earlier_seq < seq:
                assert done <= effect.received_at + 0.001, (
                    f"key {key}: seq {seq} arrived before {earlier_seq} ended"
                )


# -- parts of the pipeline, one per process -------------------------------------------------------


class RecordingDeliverer(RowByRow):
    """Records each delivery; can hang on its first row (to be killed) or fail poison rows."""

    def __init__(
        self, container: OutboxContainer, name: str, *, hang_first: bool, takes_seconds: float = 0.0
    ) -> None:
        self.container = container
        self.name = name
        self.hang_first = hang_first
        self.takes_seconds = takes_seconds  # a delivery that takes time, like a real publish

    def needs_fresh_lease(self, row: ClaimedRow) -> bool:
        """It writes an effect like a handler: a whole lease before each row."""
        del row
        return True

    def span_kind(self, row: ClaimedRow) -> SpanKind:
        del row
        return SpanKind.INTERNAL

    async def deliver(self, row: ClaimedRow, token: uuid.UUID, limit: TimeLimit) -> Delivered:
        async with limit():  # it stands for a publish: the whole of it is the delivery
            return await self._deliver(row, token)

    async def _deliver(self, row: ClaimedRow, token: uuid.UUID) -> Delivered:
        if self.hang_first:
            print("claimed", flush=True)  # the test waits for this line, then kills us
            await asyncio.sleep(3600)
        await asyncio.sleep(self.takes_seconds)
        async with self.container.database().session() as session:
            await session.exec(
                sa.insert(DELIVERIES).values(
                    row_id=str(row.id),
                    seq=row.seq,
                    ordering_key=row.ordering_key,
                    processor=self.name,
                    token=str(token),
                    delivered_at=time.time(),
                )
            )
            await session.commit()
        if row.payload.get("poison"):
            msg = "poison message"
            raise ValueError(msg)
        return Delivered.NEEDS_STAMP


async def pending(container: OutboxContainer) -> int:
    return (await container.admin().count_pending("outbox"))[0].pending


async def processor(args: argparse.Namespace) -> None:
    container = service_container(
        make_settings(
            args.db,
            application={"namespace": args.namespace, "instance_id": args.name},
            outbox={
                "lease_seconds": args.lease,
                "delivery_timeout_seconds": longest_delivery(args.lease),
                "max_retries": args.max_retries,
                "retry_backoff_base_seconds": 0.05,
                "batch_size": args.batch,
            },
        )
    )
    await install_kit(container, create_tables=False)
    values = {**source_settings(container.settings(), container.database()).__dict__}
    source = TableSource(
        name="outbox",
        table=OUTBOX_TABLE,
        name_column="event_name",
        settings=SourceSettings(**values),
        database=container.database(),
        deliverer=RecordingDeliverer(
            container, args.name, hang_first=args.hang_first, takes_seconds=args.delivery_seconds
        ),
        clock=system_clock,
        instance_id=args.name,
        metrics=container.metrics(),
    )
    wake = WakeSignal()
    await asyncio.sleep(max(0.0, float(args.start_at) - time.time()))  # start together with the others
    if args.wait_for_cue:  # started and connected ahead of its cue: its start-up costs the test nothing
        cue = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, cue.set)
        print("ready", flush=True)
        await cue.wait()
    loop = Processor(source, wake=wake.subscribe(), interval_seconds=args.interval, clock=system_clock)
    tasks = [asyncio.create_task(loop.run())]
    if args.listen:
        (listener,) = build_listeners(container.settings(), container.data_sources(), wake)
        tasks.append(asyncio.create_task(listener.run()))
        await asyncio.wait_for(listener.connected.wait(), 10)
        print("listening", flush=True)
    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        if args.until_empty and await pending(container) == 0:
            break
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await container.database().dispose()


# Once both racers have arrived, the first inside its handler waits this long before it writes:
# the other is then at its inbox insert, which must wait on the row's key until this commits.
RACE_OVERLAP_SECONDS = 0.5


def arrived(barrier: Path, name: str) -> None:
    """Announce that this racer's copy reached the consume pipeline (its inbox insert is next)."""
    (barrier / f"arrived-{name}").touch()


def barrier_handler(barrier: Path, name: str) -> Callable[[CounterChangedV1, UnitOfWork], Awaitable[None]]:
    """A handler that waits until both racers' copies have arrived, and then a moment more, before
    it writes: the other racer is then inside its inbox insert, in the race, not behind it."""

    async def handler(event: CounterChangedV1, uow: UnitOfWork) -> None:
        del event
        deadline = time.monotonic() + 30
        while len(list(barrier.glob("arrived-*"))) < 2:  # noqa: ASYNC240 (two tiny files, polled)
            if time.monotonic() > deadline:
                msg = "the other consumer's copy never arrived"
                raise RuntimeError(msg)
            await asyncio.sleep(0.02)
        await asyncio.sleep(RACE_OVERLAP_SECONDS)
        print("entered", flush=True)
        await record_effect(sql(uow), f"consumed-by-{name}")

    return handler


class AnnouncedPipeline:
    """The consume pipeline, announcing each arrival (:func:`arrived`) before it runs."""

    def __init__(self, pipeline: ConsumePipeline, barrier: Path, name: str) -> None:
        self._pipeline = pipeline
        self._barrier = barrier
        self._name = name

    async def consume(
        self, consumer: Consumer[Any], headers: Mapping[str, object], body: bytes
    ) -> ConsumeOutcome:
        arrived(self._barrier, self._name)
        return await self._pipeline.consume(consumer, headers, body)


async def consumer(args: argparse.Namespace) -> None:
    """Consume one message (the same one in two processes) through the real pipeline."""
    container = service_container(make_settings(args.db, application={"namespace": args.namespace}))
    await install_kit(container, create_tables=False)
    handler = barrier_handler(Path(args.barrier), args.name)
    container.handlers().consume("kit.racer", CounterChangedV1, handler)
    (racer,) = [c for c in container.handlers().consumers if c.name == "kit.racer"]
    context = CapturedContext("acme", "alice", None, "race-1", None)
    # A true copy: both processes build the same bytes (an event's id and time are its own,
    # and the inbox dead-letters a same-id message whose body differs).
    occurred_on = datetime.fromtimestamp(float(args.start_at), UTC)  # the same in both processes
    event = CounterChangedV1(
        counter_id="c", value=1, event_id=uuid.UUID(args.message_id), occurred_on=occurred_on
    )
    body = json.dumps(event.model_dump(mode="json")).encode()
    message = Envelope(args.message_id, "kit.counter-changed.v1", occurred_on, body, context)
    headers = container.signer().sign(message.headers(), body)
    start_at = float(args.start_at)
    await asyncio.sleep(max(0.0, start_at - time.time()))
    arrived(Path(args.barrier), args.name)
    outcome = await container.pipeline().consume(racer, headers, body)
    print(outcome.value, flush=True)
    await container.database().dispose()


async def broker_racer(args: argparse.Namespace) -> None:
    """Consume ``kit.racer`` from a real RabbitMQ queue beside another process; report whether
    this process's copy was consumed or skipped as a duplicate, once it has handled one."""
    container = service_container(
        make_settings(
            args.db,
            application={"namespace": args.namespace},
            message_bus={"transport": "rabbitmq", "url": SERVICE_URLS["rabbitmq"]},
        )
    )
    await install_kit(container, create_tables=False)
    handler = barrier_handler(Path(args.barrier), args.name)
    container.handlers().consume("kit.racer", CounterChangedV1, handler)
    announced = AnnouncedPipeline(container.pipeline(), Path(args.barrier), args.name)
    container.pipeline.override(providers.Object(announced))
    bus = container.bus()
    await bus.start()
    await bus.start_consuming()
    print("ready", flush=True)
    registry = container.metrics().registry

    def count(metric: str) -> float:
        return registry.get_sample_value(metric, {"consumer": "kit.racer"}) or 0.0

    deadline = time.monotonic() + args.seconds
    try:
        while time.monotonic() < deadline:
            consumed, duplicate = count("inbox_consumed_total"), count("inbox_duplicates_total")
            if consumed or duplicate:
                print("consumed" if consumed else "duplicate", flush=True)
                return
            await asyncio.sleep(0.05)
    finally:
        await bus.stop()
        await container.database().dispose()


async def crasher(args: argparse.Namespace) -> None:
    """Consume ``kit.crasher`` from a real broker with a handler that kills the process (no
    cleanup, no acknowledgement). Exits 3 from inside the handler; exits 0 once the message is
    in the consumer's dead-letter destination instead (the crash guard put it there)."""
    container = service_container(
        make_settings(
            args.db,
            application={"namespace": args.namespace},
            message_bus={
                "transport": args.transport,
                "url": SERVICE_URLS[args.transport],
                "max_delivery_attempts": 2,
                "redelivery_delay_seconds": 0.3,
            },
        )
    )
    await install_kit(container, create_tables=False)

    async def dies(event: CounterChangedV1, uow: UnitOfWork) -> None:
        del event, uow
        print("handling", flush=True)
        os._exit(3)  # a crash: no except, no finally, no ack

    container.handlers().consume("kit.crasher", CounterChangedV1, dies)
    bus = container.bus()
    await bus.start()
    await bus.start_consuming()
    deadline = time.monotonic() + args.seconds
    try:
        while time.monotonic() < deadline:
            letters = await bus.dead_letters("kit.crasher")  # type: ignore[attr-defined]
            if letters:
                attempts = letters[0].headers.get("x-attempts")
                print(json.dumps({"error": letters[0].error, "attempts": attempts}), flush=True)
                return
            await asyncio.sleep(0.2)
    finally:
        await bus.stop()
        await container.database().dispose()


def add_part_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``processor``, ``consumer``, ``crasher`` and ``broker-racer``."""
    parser.add_argument("--db", required=True)
    parser.add_argument("--name", default="p1")
    parser.add_argument("--namespace", default="reliability")
    parser.add_argument("--lease", type=float, default=30)
    parser.add_argument("--max-retries", type=int, default=3)
    parser.add_argument("--batch", type=int, default=50)
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--seconds", type=float, default=120)
    parser.add_argument("--hang-first", action="store_true")
    parser.add_argument("--listen", action="store_true")
    parser.add_argument("--until-empty", action="store_true")
    parser.add_argument("--wait-for-cue", action="store_true", help="poll only after a SIGUSR1")
    parser.add_argument("--message-id", default="")
    parser.add_argument("--start-at", default="0")
    parser.add_argument("--barrier", default=".")
    parser.add_argument("--transport", default="rabbitmq")
    parser.add_argument("--delivery-seconds", type=float, default=0.0)


# -- the service's worker, faults injected --------------------------------------------------------


LEDGER = CONSUMER  # the hostile-message helpers of the broker tests read this consumer's letters
RELAY_POISON = -1  # an event whose publish fails while the poison file exists
HANDLER_POISON = -7777  # an event whose consumer handler always fails (dead-lettered by the bus)
CRASHED_AFTER_PUBLISH = 9  # the exit status of --crash-after-publish


async def record_receipt(
    uow: UnitOfWork, worker: str, label: str, value: int, ordering_key: str | None
) -> None:
    """The effect of a handler here: what it saw, under which caller, in its unit of work."""
    context = current_context()
    await sql(uow).session.exec(
        sa.insert(RECEIVED).values(
            label=label,
            ordering_key=ordering_key,
            value=value,
            tenant_id=context.tenant_id,
            user_id=context.user_id,
            roles=",".join(context.roles),
            correlation_id=context.correlation_id,
            worker=worker,
            received_at=time.time(),
        )
    )


def ledger_handler(worker: str) -> Callable[[CounterChangedV1, UnitOfWork], Awaitable[None]]:
    async def handler(event: CounterChangedV1, uow: UnitOfWork) -> None:
        if event.value == HANDLER_POISON:
            msg = "a handler that fails on this message every time"
            raise RuntimeError(msg)
        await record_receipt(uow, worker, event.counter_id, event.value, event.aggregate_id)

    return handler


def noted_handler(
    container: OutboxContainer, process: str, seconds: float
) -> Callable[[Noted, UnitOfWork], Awaitable[None]]:
    """A local domain-event handler that takes ``seconds``: its start is recorded in a
    transaction of its own (kept even if the process dies mid-handler), its effect in the
    handler's unit of work (kept only if the delivery commits)."""

    async def record_start(text: str) -> None:
        async with container.database().session() as session:
            await session.exec(
                sa.insert(DELIVERIES).values(
                    row_id=text, seq=0, processor=process, token="-", delivered_at=time.time()
                )
            )
            await session.commit()

    async def handler(event: Noted, uow: UnitOfWork) -> None:
        # The test's own record, outside the handler's scope (the service refuses a handler
        # that commits: see the architecture tests), so it survives the process's death.
        await asyncio.create_task(record_start(event.text), context=contextvars.Context())
        print(f"handling {event.text}", flush=True)
        await asyncio.sleep(seconds)
        await record_receipt(uow, process, event.text, 0, None)

    return handler


def build(args: argparse.Namespace) -> OutboxContainer:
    return service_container(
        make_settings(
            args.db,
            application={"namespace": args.namespace, "instance_id": args.name},
            database={"bookkeeping_idle_timeout_seconds": 5.0},  # a frozen worker's locks end soon
            message_bus={
                "transport": args.transport,
                "url": args.url,
                "max_delivery_attempts": 3,
                "redelivery_delay_seconds": 1.0,
                "circuit_reset_seconds": 1.0,
            },
            outbox={
                "lease_seconds": args.lease,
                "delivery_timeout_seconds": longest_delivery(args.lease),
                "batch_size": args.batch,
                "max_retries": args.max_retries,
                "retry_backoff_base_seconds": args.backoff,
                "polling_interval_seconds": args.interval,
                "shutdown_timeout_seconds": args.shutdown_timeout,
                "processing_delay_seconds": args.processing_delay,
            },
        )
    )


DeliverPublished = Callable[
    [Sequence[ClaimedRow], int, TimeLimit], Awaitable[list[Delivered | Unrouted | BaseException]]
]


class Faults:
    """The injected faults of one process, wrapped around the real outbox deliverer."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.crash_after = args.crash_after_publish
        self.poison_file = Path(args.poison_file) if args.poison_file else None
        self.published = 0
        self.after_publish = args.after_publish_seconds

    def wrap(
        self, deliver: Callable[[ClaimedRow, uuid.UUID, TimeLimit], Awaitable[Delivered | Unrouted]]
    ) -> Any:
        async def faulty(row: ClaimedRow, token: uuid.UUID, limit: TimeLimit) -> Delivered | Unrouted:
            poisoned = self.poison_file is not None and self.poison_file.exists()
            if poisoned and row.payload.get("value") == RELAY_POISON:
                msg = "poison event (the bug a later deploy fixes)"
                raise ValueError(msg)
            result = await deliver(row, token, limit)
            if self.after_publish:  # a slow confirm: the moment before the stamp, announced
                print(f"published {row.id}, not stamped yet", flush=True)
                async with limit():  # part of the publish
                    await asyncio.sleep(self.after_publish)
            self.published += 1
            if self.crash_after and self.published >= self.crash_after:
                print("crashing after a confirmed publish", flush=True)
                os._exit(CRASHED_AFTER_PUBLISH)  # no stamp, no cleanup: the crash under test
            return result

        return faulty

    def wrap_published(self, deliver_published: DeliverPublished) -> Any:
        """The same faults around a batch published together: poisoned rows fail alone, the
        rest is published; the slow confirm and the crash come after the batch's confirms,
        before its stamp."""

        async def faulty(
            rows: Sequence[ClaimedRow], window: int, limit: TimeLimit
        ) -> list[Delivered | Unrouted | BaseException]:
            poisoned = self.poison_file is not None and self.poison_file.exists()
            poison = {row.id for row in rows if poisoned and row.payload.get("value") == RELAY_POISON}
            published = iter(await deliver_published([r for r in rows if r.id not in poison], window, limit))
            outcomes = [
                ValueError("poison event (the bug a later deploy fixes)")
                if row.id in poison
                else next(published)
                for row in rows
            ]
            confirmed = [
                row for row, outcome in zip(rows, outcomes, strict=True) if outcome is Delivered.NEEDS_STAMP
            ]
            if self.after_publish and confirmed:  # a slow confirm: the moment before the stamp, announced
                print(
                    f"published {confirmed[0].id} and {len(confirmed) - 1} more, not stamped yet", flush=True
                )
                async with limit():  # part of the publish
                    await asyncio.sleep(self.after_publish)
            self.published += len(confirmed)
            if self.crash_after and self.published >= self.crash_after:
                print("crashing after a confirmed publish", flush=True)
                os._exit(CRASHED_AFTER_PUBLISH)  # no stamp, no cleanup: the crash under test
            return outcomes

        return faulty


class ProcessFigures:
    """Claims counted per process, written with the service's metrics to the status file."""

    def __init__(self, container: OutboxContainer, path: Path | None) -> None:
        self.claims = 0
        self.container = container
        self.path = path

    def count_claims(self, source: TableSource) -> None:
        claim = source.claim

        async def counted(token: uuid.UUID, now: datetime | None = None) -> list[ClaimedRow]:
            self.claims += 1
            return await claim(token, now)

        source.claim = counted  # type: ignore[method-assign]

    def snapshot(self) -> dict[str, float]:
        registry = self.container.metrics().registry
        figures: dict[str, float] = {"claims": self.claims}
        for metric in registry.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    figures[sample.name] = figures.get(sample.name, 0.0) + sample.value
        return figures

    async def write_every(self, seconds: float) -> None:
        if self.path is None:
            return
        partial = self.path.with_suffix(".tmp")
        while True:
            partial.write_text(json.dumps(self.snapshot()))
            partial.replace(self.path)  # atomic: a reader never sees half a file
            await asyncio.sleep(seconds)


async def die_with_the_test(parent: int) -> None:
    """Stop (SIGTERM to ourselves) once the test process that started us is gone: a test run
    killed outright cannot reap its workers, and they must not run on for ever."""
    while os.getppid() == parent:  # noqa: ASYNC110 (no event tells a parent's death; polled)
        await asyncio.sleep(1.0)
    os.kill(os.getpid(), signal.SIGTERM)


def dump_tasks() -> None:
    """SIGUSR1: every task's chain of awaits into the log (what a scenario that timed out shows;
    ``Task.print_stack`` stops at the task's outermost coroutine)."""
    for task in asyncio.all_tasks():
        print(f"task {task.get_name()}:", file=sys.stderr)
        awaited: Any = task.get_coro()
        while awaited is not None:
            frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
            if frame is not None:
                print(
                    f"  {frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}", file=sys.stderr
                )
            awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
    sys.stderr.flush()


async def work(args: argparse.Namespace) -> None:
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, dump_tasks)
    orphaned = asyncio.create_task(die_with_the_test(os.getppid()))
    container = build(args)
    await install_kit(container, create_tables=False)
    container.handlers().on_domain_event(Noted, noted_handler(container, args.name, args.handler_seconds))
    if args.commits:
        await commit_notes(container, args)
        return
    if not args.relay_only:
        container.handlers().consume(LEDGER, CounterChangedV1, ledger_handler(args.name))
    deliverer = container.outbox_deliverer()
    faults = Faults(args)
    deliverer.deliver = faults.wrap(deliverer.deliver)  # type: ignore[method-assign]
    deliverer.deliver_published = faults.wrap_published(deliverer.deliver_published)  # type: ignore[method-assign]
    figures = ProcessFigures(container, Path(args.status) if args.status else None)
    for source in container.sources():
        if source.name == "outbox":
            figures.count_claims(source)
    status = asyncio.create_task(figures.write_every(0.2))
    try:
        if args.wait_for_cue:  # imported and built ahead of its cue: its start-up costs the scenario nothing
            cue = asyncio.Event()
            asyncio.get_running_loop().add_signal_handler(CUE, cue.set)
            print(READY_FOR_THE_CUE, flush=True)
            await cue.wait()
        await run_worker(container)
    finally:
        status.cancel()
        orphaned.cancel()
        if figures.path is not None:
            figures.path.write_text(json.dumps(figures.snapshot()))
    print("stopped", flush=True)


async def commit_notes(container: OutboxContainer, args: argparse.Namespace) -> None:
    """The API side (``--commits N``): N commits of a counter with three notes each, under a
    tenant of their own; the notes are local domain events this process dispatches in-process
    right after each commit (the worker takes over whatever this process does not finish)."""
    units = container.units_of_work()
    for commit in range(args.commits):
        with use_context(
            RequestContext(
                tenant_id=f"tenant-{commit % 7}",
                user_id=args.name,
                roles=("clerk",),
                correlation_id=f"{args.name}-{commit}",
            )
        ):
            async with units() as uow:
                counter = Counter.create(f"tenant-{commit % 7}")
                for note in range(3):
                    counter.note(f"{args.name}-{commit}-{note}")
                uow.repository(Counters).add(counter)
                await uow.commit()  # and its notes dispatched here, in-process
    await container.database().dispose()


PARTS = {"processor": processor, "consumer": consumer, "crasher": crasher, "broker-racer": broker_racer}


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``worker``."""
    parser.add_argument("--db", required=True)
    parser.add_argument("--transport", required=True)
    parser.add_argument("--url", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--lease", type=float, default=5.0)
    parser.add_argument("--batch", type=int, default=50)
    parser.add_argument("--max-retries", type=int, default=3)
    parser.add_argument("--backoff", type=float, default=0.05)
    parser.add_argument("--interval", type=float, default=0.2)
    parser.add_argument("--shutdown-timeout", type=float, default=5.0)
    parser.add_argument("--crash-after-publish", type=int, default=0)
    parser.add_argument("--poison-file", default="")
    parser.add_argument("--after-publish-seconds", type=float, default=0.0)
    parser.add_argument("--relay-only", action="store_true", help="no consumer in this process")
    parser.add_argument("--wait-for-cue", action="store_true", help="start working only after a SIGUSR2")
    parser.add_argument("--status", default="")
    parser.add_argument(
        "--commits", type=int, default=0, help="be an API process: commit this often, then exit"
    )
    parser.add_argument("--handler-seconds", type=float, default=0.0)
    parser.add_argument("--processing-delay", type=float, default=5.0)


def harness_service(settings: ServiceSettings) -> OutboxContainer:
    """The kit's own service, whose commands the kit's suite runs (``service ...``): the kit's
    container with the test context's messages and one consumer, ``LEDGER``, recording what it
    receives."""
    container = kit_container(settings)
    register_kit(container)
    container.handlers().consume(LEDGER, CounterChangedV1, ledger_handler("service"))
    return container


def main(argv: list[str] | None = None) -> None:
    arguments = sys.argv[1:] if argv is None else argv
    if arguments[:1] == ["service"]:  # the service's command line, on the suite's container
        build = service_container if CONTAINER_VARIABLE in os.environ else harness_service
        cli.main(ServiceSettings, build, project=Path.cwd(), argv=arguments[1:])
    parser = argparse.ArgumentParser(prog="python -m outbox_kit.testing.processes")
    roles = parser.add_subparsers(dest="role", required=True)
    add_worker_arguments(roles.add_parser("worker", help="the service's worker, faults injected"))
    for role in PARTS:
        add_part_arguments(roles.add_parser(role))
    args = parser.parse_args(arguments)
    if args.role == "worker":
        logging.basicConfig(
            level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s %(message)s"
        )
        asyncio.run(work(args))
    else:
        asyncio.run(PARTS[args.role](args))


if __name__ == "__main__":
    main()
