"""The machinery of the conformance scenarios (``test_conformance.py``).

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

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from outbox_kit.persistence.tables import (
    OUTBOX_TABLE,
)
from outbox_kit.persistence.unit_of_work import (
    SqlUnitOfWork,
)
from outbox_kit.testing.fixtures import acting_as, fetch, make_settings
from outbox_kit.testing.harness import RECEIVED, CounterChangedV1, install_kit

from {{ cookiecutter.package_name }}.container import Container, build_container

PROJECT = Path(__file__).resolve().parents[2]
REPORT: list[dict[str, Any]] = []
DUPLICATE_LINE = "skipped duplicate message"  # the inbox's log line for a copy it did not run


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
    container: Container,
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
        env = {k: v for k, v in os.environ.items() if "__" not in k}  # no service settings leak in
        command = [
            sys.executable,
            "-m",
            "tests.reliability.service_actor",
            *("--db", self.database_url, "--transport", self.transport, "--url", self.broker_url),
            *("--namespace", self.namespace, "--name", name, "--status", str(status)),
            *self.options,
            *options,
        ]
        with log.open("wb") as output:
            process = subprocess.Popen(command, cwd=PROJECT, env=env, stdout=output, stderr=subprocess.STDOUT)
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
        for name in list(self.workers):
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


async def never_runs(event: CounterChangedV1, uow: SqlUnitOfWork) -> None:
    del event, uow  # the test process only declares the consumer's queue; workers consume


@asynccontextmanager
async def declared_topology(
    database_url: str,
    namespace: str,
    consumer: str,
    bus_settings: dict[str, Any],
    *,
    fresh_tables: bool = False,
) -> AsyncIterator[Container]:
    """A container on ``namespace`` whose started bus has declared ``consumer``'s queue or
    stream (its handler never runs here: worker processes consume), so nothing a worker
    publishes is unroutable; the topology is deleted afterwards, messages included.
    ``fresh_tables`` (re)creates and empties the kit's tables."""
    container = build_container(
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


async def received(container: Container) -> list[Any]:
    return await fetch(container, sa.select(RECEIVED).order_by(RECEIVED.c.id))


async def outbox_rows(container: Container) -> list[Any]:
    return await fetch(container, sa.select(OUTBOX_TABLE).order_by(OUTBOX_TABLE.c.seq))


async def wait_until(check: Callable[[], Awaitable[bool]], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            msg = f"not within {timeout} s: {what}"
            raise AssertionError(msg)
        await asyncio.sleep(0.25)


async def all_received(container: Container, sent: list[Sent], timeout: float) -> None:
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
    container: Container,
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
    runs = Counter(row.label for row in effects)
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
