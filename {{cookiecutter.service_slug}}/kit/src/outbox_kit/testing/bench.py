"""The relay against the raw broker, in one run: ``python -m outbox_kit.testing.bench`` (a
service's ``make bench ARGS='...'``).

Every figure is measured in this run against the configured PostgreSQL and broker and compared
with the targets of the performance issue. Ratios are taken A B A B: in each of ``--rounds``
rounds the reference (raw publish, outbox off, keyless, ...) and the measured variant run back
to back, the ratio is taken within the round, and the table shows the median and the range of
the rounds with the absolute medians next to it. Nothing is asserted: the machine is shared and
noisy, read the range before the median.

Sections (``--only drain,e2e,...``):

* ``drain``: N rows relayed by 1 and by 2 worker processes to a raw counting consumer, against
  FastStream publishing the same N relay-shaped messages 64 in flight (and the same on NATS
  JetStream unless ``--no-nats``);
* ``e2e``: the same with the real consume pipeline (signature, inbox, handler) as the consumer;
* ``write``: commits/s of a one-row command with the outbox on against off, 1 and 8 writers;
* ``latency``: commit to consumer handler at a steady 100 and 200 events/s, worker and
  consumer in other processes (the worker woken by NOTIFY);
* ``backlog``: the relay's claim + stamp throughput with 10k, 100k and 1M pending rows, and the
  worker's maximum resident memory while draining the smallest and the largest backlog;
* ``ordered``: relay drain of N rows over 100 ordering keys against keyless, 1 and 2 workers;
* ``idle``: statements per second of one worker at default settings on an empty outbox.

Beside every rate, the CPU time spent per unit of work, read from the processes' own CPU time
(user + system, every thread) around the measured window: per row for the relay's worker(s),
per message for the consumer, per commit for the writer. On a shared machine it is the stable
figure; rates and ratios move with the neighbours.

``--set OUTBOX__BATCH_SIZE=100`` (repeatable) applies a service setting to every process;
``BENCH_PROFILE_DIR=folder`` records a py-spy profile of every worker and consumer child (if py-spy is
installed). Results go to ``--json`` and ``--markdown`` (the table of docs/performance.md).

It measures a service's own container: the one ``OUTBOX_KIT_TEST_CONTAINER`` names
(``module:function``; a service's ``make bench`` sets it to its ``build_container``), in the
service's root (its migrations prepare the database).

What every benchmark scenario shares: targets, bench events, row writing, child processes.

* :class:`Target` is one database + one transport + one namespace. ``settings()`` builds the
  service's settings for it (outbox and inbox on, signed headers, logging at
  WARNING) and ``env()`` gives the same configuration to a child process as environment
  variables (``SECTION__KEY``), so the parent and its children always agree.
* :class:`BenchTicked` (keyless) and :class:`BenchKeyed` (``ordered=True``: its ``aggregate_id``
  is the ordering key) carry ``sent_at`` (``time.time()`` when the event was made, for latency)
  and a filler, so a published body is about 250 bytes.
* :func:`write_events` commits rows through the real unit of work, 200 events per commit, under
  a request context (tenant, user, correlation), exactly as a command handler would.
* :class:`Child` runs ``python -m outbox_kit.testing.bench actor <role>`` and talks to it one
  line at a time (``ready``, ``go``, ``count``, ``done``, ``stats``). With ``BENCH_PROFILE_DIR`` set, every
  worker child is sampled by ``py-spy record --format raw`` into that folder.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import os
import platform
import resource
import shutil
import signal
import sys
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit, urlunsplit

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine
from sqlmodel import SQLModel

from outbox_kit.application.context import (
    RequestContext,
    capture_context,
    use_context,
)
from outbox_kit.application.handlers import Consumer
from outbox_kit.application.messages import (
    IntegrationEvent,
)
from outbox_kit.application.unit_of_work import (
    UnitOfWork,
)
from outbox_kit.consume.inbox import ConsumeOutcome, ConsumePipeline
from outbox_kit.persistence.tables import (
    COMMAND_TABLE,
    OUTBOX_TABLE,
    InboxMessage,
)
from outbox_kit.runtime import cli
from outbox_kit.runtime.container import OutboxContainer, build_transport
from outbox_kit.runtime.heap import freeze_start_up_heap
from outbox_kit.runtime.settings import ServiceSettings
from outbox_kit.testing.fixtures import service_container
from outbox_kit.transports.base import FastStreamTransport
from outbox_kit.transports.bus import MessageBus, PublishResult
from outbox_kit.transports.envelope import (
    Envelope,
)
from outbox_kit.transports.received import BrokerDelivery
from outbox_kit.transports.settings import (
    EndpointNames,
)

URLS = {
    "rabbitmq": "amqp://guest:guest@127.0.0.1:5672/",
    "nats": "nats://127.0.0.1:4222",
    "redis": "redis://127.0.0.1:6379",
}
DEFAULT_DATABASE = os.environ.get("DATABASE__URL") or "postgresql+asyncpg://postgres@127.0.0.1:5432/bench"
COUNTER = "bench.counter"  # the consumer name the counting child (or the real consumer) uses
PER_COMMIT = 200
FILLER = "bench-" + "x" * 114  # 120 characters: with the ids and times, a ~250-byte body
PROFILE_ENV = "BENCH_PROFILE_DIR"
BENCH_CONTEXT = RequestContext(tenant_id="bench", user_id="bench", correlation_id="bench")
# The tables every scenario empties first (the relay's own, and the inbox the consumer fills).
RELAY_TABLES = (OUTBOX_TABLE.name, COMMAND_TABLE.name, InboxMessage.__tablename__)


class BenchTicked(IntegrationEvent, name="bench.ticked.v1"):
    """A keyless bench event."""

    number: int
    sent_at: float
    filler: str = FILLER


class BenchKeyed(IntegrationEvent, name="bench.keyed.v1", ordered=True):
    """A bench event ordered by its ``aggregate_id`` (the ordering key)."""

    number: int
    sent_at: float
    filler: str = FILLER


EVENT_TYPES: dict[str, type[BenchTicked | BenchKeyed]] = {"ticked": BenchTicked, "keyed": BenchKeyed}


def ticked(number: int) -> BenchTicked:
    return BenchTicked(number=number, sent_at=time.time())


def keyed(number: int, keys: int) -> BenchKeyed:
    return BenchKeyed(number=number, sent_at=time.time(), aggregate_id=f"key-{number % keys}")


def make_events(count: int, *, keys: int = 0) -> list[BenchTicked | BenchKeyed]:
    """``count`` events; with ``keys`` they cycle over that many ordering keys."""
    return [keyed(n, keys) if keys else ticked(n) for n in range(count)]


def _nested(overrides: dict[str, str]) -> dict[str, dict[str, Any]]:
    """``{"OUTBOX__BATCH_SIZE": "100"}`` -> ``{"outbox": {"batch_size": "100"}}``."""
    sections: dict[str, dict[str, Any]] = {}
    for key, value in overrides.items():
        section, _, name = key.lower().partition("__")
        sections.setdefault(section, {})[name] = value
    return sections


@dataclass(frozen=True)
class Target:
    """One database, one transport and one namespace (fresh per scenario: fresh queues)."""

    database: str
    transport: str = "rabbitmq"
    url: str = URLS["rabbitmq"]
    namespace: str = "bench"
    # Environment-style settings (``OUTBOX__BATCH_SIZE=100``) applied to parent and children.
    overrides: dict[str, str] = field(default_factory=dict)

    def fresh(self, **changes: Any) -> Target:
        """A copy with a new namespace (so new queues/streams) and ``changes`` applied."""
        return replace(self, namespace=f"bench{uuid.uuid4().hex[:8]}", **changes)

    def base_sections(self) -> dict[str, dict[str, Any]]:
        return {
            "application": {"namespace": self.namespace},
            "database": {"url": self.database},
            "message_bus": {
                "transport": self.transport,
                "url": self.url,
                "enable_outbox": True,
                "enable_inbox": True,
                "signing_keys": "bench:bench-secret",
                "signing_key_id": "bench",
            },
            "logging": {"level": "WARNING"},
        }

    def settings(self, **sections: dict[str, Any]) -> ServiceSettings:
        """The service's settings for this target; ``sections`` override single keys."""
        merged = self.base_sections()
        for extra in (_nested(self.overrides), sections):
            for name, values in extra.items():
                merged[name] = merged.get(name, {}) | values
        build: Any = ServiceSettings  # sections as keyword arguments: mypy cannot type them
        return cast("ServiceSettings", build(_env_file=None, **merged))  # no .env file

    def env(self, **sections: dict[str, Any]) -> dict[str, str]:
        """The same configuration as environment variables for a child process."""
        merged = self.base_sections()
        for name, values in sections.items():
            merged[name] = merged.get(name, {}) | values
        env = {k: v for k, v in os.environ.items() if "__" not in k}  # no stray service settings
        for name, values in merged.items():
            for key, value in values.items():
                env[f"{name}__{key}".upper()] = str(value).lower() if isinstance(value, bool) else str(value)
        env.update(self.overrides)
        return env


def bench_container(settings: ServiceSettings) -> OutboxContainer:
    """The service's container with the bench events registered."""
    container = service_container(settings)
    container.registry().register(BenchTicked, BenchKeyed)
    return container


async def write_events(
    container: OutboxContainer, events: Sequence[IntegrationEvent], per_commit: int = PER_COMMIT
) -> None:
    """Commit ``events`` as outbox rows through the real unit of work, ``per_commit`` at a time."""
    units = container.units_of_work()
    with use_context(BENCH_CONTEXT):
        for first in range(0, len(events), per_commit):
            async with units() as uow:
                for event in events[first : first + per_commit]:
                    uow.enqueue(event)
                await uow.commit()


async def execute(url: str, *statements: str, autocommit: bool = False) -> list[Any]:
    """Run raw SQL statements on ``url``; the first column of each statement's first row."""
    engine = create_async_engine(url, isolation_level="AUTOCOMMIT" if autocommit else None)
    answers: list[Any] = []
    try:
        async with engine.begin() as connection:
            for statement in statements:
                result = await connection.execute(sa.text(statement))
                answers.append(result.scalar() if result.returns_rows else None)
    finally:
        await engine.dispose()
    return answers


async def empty_outbox(url: str) -> None:
    """Empty the relay's tables (outbox, internal commands, inbox) on the bench database."""
    await execute(url, f"TRUNCATE {', '.join(RELAY_TABLES)}")


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100, nearest rank); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def median(values: Iterable[float]) -> float:
    kept = sorted(v for v in values if v == v)  # noqa: PLR0124 (drops NaN)
    if not kept:
        return float("nan")
    middle = len(kept) // 2
    return kept[middle] if len(kept) % 2 else (kept[middle - 1] + kept[middle]) / 2


class ChildError(RuntimeError):
    """A child process ended or timed out before saying what was expected."""


_profiles = {"count": 0, "warned": False}


class Child:
    """``python -m bench.actor <role> ...`` with a line protocol on stdin/stdout."""

    def __init__(self, role: str, args: Sequence[str], env: dict[str, str]) -> None:
        self.role = role
        self._args = list(args)
        self._env = env
        self._process: asyncio.subprocess.Process | None = None
        self._lines: asyncio.Queue[str | None] = asyncio.Queue()
        self._reader: asyncio.Task[None] | None = None
        self._profiler: asyncio.subprocess.Process | None = None
        self.lines: list[str] = []  # every line the child printed

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def process(self) -> asyncio.subprocess.Process:
        if self._process is None:
            msg = f"{self.role}: not started"
            raise ChildError(msg)
        return self._process

    async def start(self) -> Child:
        self._process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "outbox_kit.testing.bench",
            "actor",
            self.role,
            *self._args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=self._env,
        )
        self._reader = asyncio.create_task(self._read())
        if self.role in {"worker", "consumer"}:
            await self._attach_profiler()
        return self

    async def _read(self) -> None:
        stdout = self.process.stdout
        assert stdout is not None
        while line := await stdout.readline():
            text = line.decode().strip()
            self.lines.append(text)
            await self._lines.put(text)
        await self._lines.put(None)

    async def _attach_profiler(self) -> None:
        folder = os.environ.get(PROFILE_ENV)
        if not folder:
            return
        py_spy = shutil.which("py-spy")
        if py_spy is None:
            if not _profiles["warned"]:
                print(f"{PROFILE_ENV} is set but py-spy is not installed (pip install py-spy): no profile")
                _profiles["warned"] = True
            return
        await asyncio.to_thread(Path(folder).mkdir, parents=True, exist_ok=True)
        _profiles["count"] += 1
        output = Path(folder) / f"{self.role}-{_profiles['count']}.txt"
        self._profiler = await asyncio.create_subprocess_exec(
            py_spy,
            *("record", "--format", "raw", "--rate", "250", "--nonblocking"),
            *("--pid", str(self.pid), "-o", str(output)),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )

    async def expect(self, prefix: str, timeout: float) -> str:
        """Wait for a line starting with ``prefix``; return the rest of it."""
        try:
            async with asyncio.timeout(timeout):
                while True:
                    line = await self._lines.get()
                    if line is None:
                        code = await self.process.wait()
                        msg = f"{self.role} exited ({code}) before printing {prefix!r}"
                        raise ChildError(msg)
                    if line == prefix or line.startswith(prefix + " "):
                        return line[len(prefix) :].strip()
        except TimeoutError:
            msg = f"{self.role} did not print {prefix!r} within {timeout:.0f} s"
            raise ChildError(msg) from None

    async def send(self, line: str) -> None:
        stdin = self.process.stdin
        assert stdin is not None
        stdin.write(line.encode() + b"\n")
        await stdin.drain()

    async def stop(self, grace: float = 10.0) -> list[str]:
        """Close stdin (the child's cue to stop), SIGTERM after ``grace``; all lines printed."""
        if self._process is None:
            return self.lines
        process = self._process
        if process.stdin is not None and not process.stdin.is_closing():
            process.stdin.close()
        try:
            await asyncio.wait_for(process.wait(), grace)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), grace)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
        if self._reader is not None:
            await asyncio.wait_for(self._reader, 10)
        if self._profiler is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._profiler.wait(), 30)
        return self.lines

    async def cpu(self) -> float:
        """The child's CPU time so far (user + system seconds, every thread)."""
        await self.send("cpu")
        return float(await self.expect("cpu", 30))

    def last(self, prefix: str) -> str | None:
        """The rest of the last line printed starting with ``prefix`` (after ``stop``)."""
        for line in reversed(self.lines):
            if line.startswith(prefix + " "):
                return line[len(prefix) :].strip()
        return None


# -- the scenarios ----------------------------------------------------------------------------------
# One function per measurement. Each uses a fresh namespace (so fresh queues, streams and
# consumers), starts from an emptied outbox, and removes its broker topology afterwards.
#
# * :func:`raw_publish`: the reference. N messages prebuilt exactly as the relay builds them (same
#   body, same signed headers, same message ids shape) are published through FastStream's own
#   ``broker.publish``, as a plain relay would (RabbitMQ: persistent, mandatory,
#   publisher-confirmed, to the service's topic exchange: ``RabbitTransport.publish_through_broker``;
#   NATS: JetStream publish with ``Nats-Msg-Id``), 64 in flight (a semaphore and ``gather``).
#   Timed from the first publish to the counting child's N-th distinct arrival.
# * :func:`relay_drain`: N rows committed by the real unit of work first (not timed), then the
#   counting child (or the real consumer with ``pipeline=True``) and one or two worker processes
#   are started and wait; timed from ``go`` to the N-th distinct arrival.
# * :func:`commit_rate`: commits per second of a small command (one row into ``bench_tallies``
#   plus, when the outbox is on, one integration event enqueued on the same unit of work) for a
#   fixed time, with 1 or N concurrent writers. "Outbox off" is the same unit of work and the same
#   enqueue with ``MESSAGE_BUS__ENABLE_OUTBOX=false`` on the in-process transport (the only
#   transport that allows it): the event is handed to the in-process bus after the commit instead
#   of becoming a row.
# * :func:`steady_latency`: one event per commit at a steady rate; the real consumer child reports the
#   p50/p99 of ``handler time - sent_at`` (``sent_at`` is taken just before the commit). The worker
#   runs in this process (woken in-process by the commit) or in a child (woken by NOTIFY).
# * :func:`fill_backlog` + :func:`claim_rate` + :func:`drain_memory`: ``size`` pending rows made
#   server-side from one row the unit of work wrote (``INSERT ... SELECT ... generate_series``,
#   new ids), ``VACUUM ANALYZE``; then the relay's own claim (``TableSource.claim``) and processed
#   stamp (``LeaseStore.stamp_processed``) are called in a loop for a fixed number of rows
#   (rows/s), and the claimed rows are put back pending between rounds; then a worker child
#   drains the backlog for a fixed time and reports its maximum resident memory.
# * :func:`idle_statements`: a worker child at default settings against an empty outbox;
#   statements per second between two ``count`` samples taken after a warm-up.
#
# Nothing here asserts a timing: the caller compares figures with the targets.


IN_FLIGHT = 64
KEYS = 100
TALLIES = "bench_tallies"


@dataclass
class Outcome:
    """One measurement: how many, how long, and whatever else the scenario observed."""

    count: int
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.count / self.seconds if self.seconds > 0 else float("nan")

    def as_json(self) -> dict[str, Any]:
        return {"count": self.count, "seconds": round(self.seconds, 4), "rate": round(self.rate, 2)} | (
            self.extra
        )


def cpu_per(count: int, receiver_seconds: float, relay_seconds: float) -> dict[str, float]:
    """CPU microseconds per message of the receiving child and of the relay's worker(s)."""
    return {
        "receiver_cpu_us": round(receiver_seconds / count * 1e6, 1),
        "relay_cpu_us": round(relay_seconds / count * 1e6, 1),
    }


def drain_timeout(count: int) -> float:
    return max(120.0, count / 20)


async def create_missing_database(url: str) -> None:
    """Create the bench's PostgreSQL database when the server does not have it yet."""
    import asyncpg

    parsed = sa.engine.make_url(url).set(drivername="postgresql")
    try:
        connection = await asyncpg.connect(parsed.render_as_string(hide_password=False))
    except asyncpg.InvalidCatalogNameError:
        server = await asyncpg.connect(parsed.set(database="postgres").render_as_string(hide_password=False))
        try:
            await server.execute(f'CREATE DATABASE "{parsed.database}"')
        finally:
            await server.close()
    else:
        await connection.close()


async def prepare(target: Target) -> None:
    """Create (when missing) and migrate the bench database (the service's migrations, found
    from the working directory; the kit's tables where there are none, as in the kit's own
    suite), and create the bench's own table."""
    if target.database.startswith("postgresql"):
        await create_missing_database(target.database)
    if (Path.cwd() / "alembic.ini").is_file():
        await asyncio.to_thread(cli.upgrade, Path.cwd(), target.database)
    else:
        engine = create_async_engine(target.database)
        try:
            async with engine.begin() as connection:
                await connection.run_sync(SQLModel.metadata.create_all)
        finally:
            await engine.dispose()
    await execute(
        target.database,
        f"CREATE TABLE IF NOT EXISTS {TALLIES} (id BIGSERIAL PRIMARY KEY, writer INT NOT NULL, "
        "number INT NOT NULL, written_at TIMESTAMPTZ NOT NULL DEFAULT now())",
    )


async def server_version(target: Target) -> str:
    (version,) = await execute(target.database, "SHOW server_version")
    return str(version)


async def _ignore(message: BenchTicked | BenchKeyed, uow: UnitOfWork) -> None:
    del message, uow


async def delete_topology(target: Target, event: str) -> None:
    """Remove the scenario's queues/streams (the service's own ``delete_topology``)."""
    container = bench_container(target.settings())
    container.handlers().consume(COUNTER, EVENT_TYPES[event], _ignore)
    bus = container.bus()
    try:
        if isinstance(bus, FastStreamTransport):
            await bus.delete_topology()
    except Exception as error:
        print(f"  (could not delete the topology of {target.namespace}: {error})")
    finally:
        await container.database().dispose()


async def receiver(target: Target, count: int, event: str, *, pipeline: bool, stages: bool = False) -> Child:
    """The counting child (raw) or the real consumer (pipeline), subscribed and ready."""
    role = "consumer" if pipeline else "counter"
    env = target.env() | ({STAGES_ENV: "1"} if stages else {})
    child = await Child(role, ["--event", event, "--expect", str(count)], env).start()
    try:
        await child.expect("ready", 60)
    except BaseException:
        await child.stop()
        raise
    return child


def parse_done(rest: str) -> tuple[float, dict[str, Any]]:
    stamp, _, summary = rest.partition(" ")
    return float(stamp), json.loads(summary)


async def workers(
    target: Target, processes: int, *, stages: bool = False, **sections: dict[str, Any]
) -> list[Child]:
    started: list[Child] = []
    env = target.env(**sections) | ({STAGES_ENV: "1"} if stages else {})
    try:
        for _ in range(processes):
            child = Child("worker", [], env)
            started.append(child)
            await child.start()
        for child in started:
            await child.expect("ready", 60)
    except BaseException:
        await stop_all(started)
        raise
    return started


async def stop_all(children: Sequence[Child]) -> list[dict[str, Any]]:
    """Stop children (in parallel); the ``stats`` each worker printed."""
    await asyncio.gather(*(child.stop() for child in children), return_exceptions=True)
    return [json.loads(stats) for child in children if (stats := child.last("stats")) is not None]


# -- throughput ---------------------------------------------------------------------------------


def prebuilt(container: OutboxContainer, count: int, *, keys: int) -> list[tuple[Envelope, dict[str, str]]]:
    """Envelopes and signed headers built as the relay builds them (``OutboxDeliverer``)."""
    registry = container.registry()
    signer = container.signer()
    messages = []
    with use_context(BENCH_CONTEXT):
        context = capture_context()
    for event in make_events(count, keys=keys):
        envelope = Envelope(
            message_id=str(uuid.uuid4()),
            event_name=event.message_name,
            occurred_on=event.occurred_on,
            body=json.dumps(registry.dump(event), separators=(",", ":")).encode(),
            context=context,
            ordering_key=event.ordering_key(),
        )
        messages.append((envelope, signer.sign(envelope.headers(), envelope.body)))
    return messages


async def raw_publish(base: Target, count: int, *, keyed: bool = False) -> Outcome:
    """FastStream's ``broker.publish`` of ``count`` relay-shaped messages, 64 in flight, to the
    counter: the reference every relay ratio is read against."""
    target = base.fresh()
    event = "keyed" if keyed else "ticked"
    settings = target.settings()
    container = bench_container(settings)
    bus = settings.message_bus
    names = EndpointNames(settings.application.namespace, bus.preserve_default_endpoint_names)
    transport = build_transport(bus, names, container.registry(), container.signer())
    messages = prebuilt(container, count, keys=KEYS if keyed else 0)
    counter = await receiver(target, count, event, pipeline=False)
    try:
        await transport.connect()
        gate = asyncio.Semaphore(IN_FLIGHT)

        # FastStream's own publish of each message, as a plain relay would call it.
        plain = getattr(transport, "publish_through_broker", transport.send)

        async def publish(envelope: Envelope, headers: dict[str, str]) -> None:
            async with gate:
                await plain(envelope, headers)

        started, cpu = time.time(), time.process_time()
        await asyncio.gather(*(publish(envelope, headers) for envelope, headers in messages))
        published, publish_cpu = time.time(), time.process_time() - cpu
        finished, summary = parse_done(await counter.expect("done", drain_timeout(count)))
        return Outcome(
            count,
            finished - started,
            {"publish_seconds": round(published - started, 4)}
            | summary
            | {"publish_cpu_us": round(publish_cpu / count * 1e6, 1)},
        )
    finally:
        await counter.stop()
        with contextlib.suppress(Exception):
            await transport.close()
        await container.database().dispose()
        await delete_topology(target, event)


async def relay_drain(
    base: Target, count: int, *, processes: int = 1, keyed: bool = False, pipeline: bool = False
) -> Outcome:
    """``count`` rows written first, then the worker process(es) started: until the last arrives."""
    target = base.fresh()
    event = "keyed" if keyed else "ticked"
    await empty_outbox(target.database)
    container = bench_container(target.settings())
    try:
        await write_events(container, make_events(count, keys=KEYS if keyed else 0))
    finally:
        await container.database().dispose()
    counter = await receiver(target, count, event, pipeline=pipeline)
    relays: list[Child] = []
    try:
        relays = await workers(target, processes)
        before = [await child.cpu() for child in [counter, *relays]]
        started = time.time()
        for child in relays:
            await child.send("go")
        finished, summary = parse_done(await counter.expect("done", drain_timeout(count)))
        spent = [await child.cpu() - at_go for child, at_go in zip([counter, *relays], before, strict=True)]
        outcome = Outcome(count, finished - started, summary | cpu_per(count, spent[0], sum(spent[1:])))
    finally:
        stats = await stop_all(relays)
        await counter.stop()
        await delete_topology(target, event)
        await empty_outbox(target.database)
    outcome.extra["workers"] = stats
    return outcome


# -- the write path -----------------------------------------------------------------------------


async def commit_rate(
    base: Target, *, writers: int, outbox_on: bool, seconds: float, keyed_events: int = 0
) -> Outcome:
    """Commits per second of a one-row command (+ one enqueued keyless event, or
    ``keyed_events`` events of as many ordering keys), ``writers`` at once."""
    target = base.fresh()
    if outbox_on:
        settings = target.settings()
    else:
        off = {"transport": "inprocess", "url": "", "enable_outbox": False, "enable_inbox": False}
        settings = target.settings(message_bus=off)
    await empty_outbox(target.database)
    container = bench_container(settings)
    units = container.units_of_work()
    insert = f"INSERT INTO {TALLIES} (writer, number) VALUES (:writer, :number)"  # noqa: S608 (a constant)
    commits = [0] * writers
    tally = sa.text(insert)

    async def command(writer: int, number: int) -> None:
        async with units() as uow:
            await uow.session.exec(tally, params={"writer": writer, "number": number})  # type: ignore[call-overload]
            for event in make_events(keyed_events, keys=keyed_events) if keyed_events else [ticked(number)]:
                uow.enqueue(event)
            await uow.commit()

    async def write(writer: int, deadline: float | None) -> None:
        number = 0
        while (deadline is None and number < 10) or (deadline is not None and time.monotonic() < deadline):
            await command(writer, number)
            number += 1
            if deadline is not None:
                commits[writer] += 1

    try:
        with use_context(BENCH_CONTEXT):
            await asyncio.gather(*(write(w, None) for w in range(writers)))  # warm the pool
            started, cpu = time.monotonic(), time.process_time()
            await asyncio.gather(*(write(w, started + seconds) for w in range(writers)))
            elapsed, cpu = time.monotonic() - started, time.process_time() - cpu
    finally:
        await container.database().dispose()
        await empty_outbox(target.database)
        await execute(target.database, f"TRUNCATE {TALLIES}")
    done = sum(commits)
    per_commit = round(cpu / done * 1e6, 1) if done else NAN
    extra = {"writers": writers, "outbox": outbox_on, "keyed_events": keyed_events, "cpu_us": per_commit}
    return Outcome(done, elapsed, extra)


# -- latency ------------------------------------------------------------------------------------


async def steady_latency(base: Target, *, in_process: bool, per_second: int, seconds: float) -> Outcome:
    """p50/p99 from commit to the real consumer's handler at a steady ``per_second``, and to each
    stage on the way (with the worker in a child): the relay's batch starts publishing (claimed
    and built), its publishes are confirmed, its rows are stamped (``processed_on``), the
    consumer picks the message up (before verification), the handler runs."""
    target = base.fresh()
    count = int(per_second * seconds)
    await empty_outbox(target.database)
    container = bench_container(target.settings())
    consumer = await receiver(target, count, "ticked", pipeline=True, stages=not in_process)
    relays: list[Child] = []
    running = False
    try:
        if in_process:
            await container.bus().start()
            await container.worker().start()
            running = True
        else:
            relays = await workers(target, 1, stages=True)
            await relays[0].send("go")
        await asyncio.sleep(1.0)  # the first (empty) claim and the LISTEN connection
        units = container.units_of_work()
        freeze_start_up_heap()  # the writer stands for the API process, frozen once started
        started = time.monotonic()
        with use_context(BENCH_CONTEXT):
            for number in range(count):
                delay = started + number / per_second - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                async with units() as uow:
                    uow.enqueue(ticked(number))
                    await uow.commit()
        written = time.monotonic() - started
        _, summary = parse_done(await consumer.expect("done", drain_timeout(count)))
        extra = summary | {"in_process": in_process, "per_second": per_second}
        if relays:
            (stats,) = await stop_all(relays)
            picked = summary.pop("stages", {})
            handled = {"p50_ms": summary["p50_ms"], "p99_ms": summary["p99_ms"]}
            stamped = await stamp_latency(target.database)
            extra["stages"] = stats.get("stages", {}) | {"stamped": stamped} | picked | {"handled": handled}
        outcome = Outcome(count, written, extra)
    finally:
        if running:
            await container.worker().stop()
        await stop_all(relays)
        await consumer.stop()
        await container.database().dispose()
        await delete_topology(target, "ticked")
        await empty_outbox(target.database)
    return outcome


async def stamp_latency(url: str) -> dict[str, float]:
    """p50/p99 milliseconds from each relayed row's ``sent_at`` to its ``processed_on``."""
    lag = "(extract(epoch FROM processed_on) - (payload->>'sent_at')::float8) * 1000"
    found = "FROM outbox_messages WHERE processed_on IS NOT NULL AND payload->>'sent_at' IS NOT NULL"
    p50, p99 = await execute(
        url,
        f"SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY {lag}) {found}",
        f"SELECT percentile_cont(0.99) WITHIN GROUP (ORDER BY {lag}) {found}",
    )
    return {"p50_ms": round(float(p50 or NAN), 2), "p99_ms": round(float(p99 or NAN), 2)}


# -- backlog ------------------------------------------------------------------------------------


async def fill_backlog(target: Target, size: int) -> None:
    """``size`` pending rows: one written by the unit of work, the rest copied server-side."""
    await empty_outbox(target.database)
    container = bench_container(target.settings())
    try:
        await write_events(container, [ticked(0)])
    finally:
        await container.database().dispose()
    table = OUTBOX_TABLE.name
    columns = [c.name for c in OUTBOX_TABLE.columns if c.name not in {"id", "seq"}]
    listed = ", ".join(columns)
    copied = ", ".join(f"o.{name}" for name in columns)
    await execute(
        target.database,
        f"INSERT INTO {table} (id, {listed}) SELECT gen_random_uuid(), {copied} "  # noqa: S608 (constants)
        f"FROM {table} o CROSS JOIN generate_series(1, {int(size) - 1})",
    )
    await execute(target.database, f"VACUUM ANALYZE {table}", autocommit=True)


async def claim_rate(target: Target, rows: int) -> Outcome:
    """The relay's claim + processed stamp in a loop for ``rows`` rows; then put them back."""
    container = bench_container(target.settings())
    database = container.database()
    (source,) = [s for s in container.sources() if s.name == "outbox"]
    clock = container.clock()
    claimed = claims = 0
    try:
        started = time.perf_counter()
        while claimed < rows:
            token = uuid.uuid4()
            batch = await source.claim(token)
            if not batch:
                break
            async with database.bookkeeping() as connection:
                await source.leases.stamp_processed(connection, [row.id for row in batch], token, clock())
            claimed += len(batch)
            claims += 1
        elapsed = time.perf_counter() - started
    finally:
        await database.dispose()
    table = OUTBOX_TABLE.name
    await execute(
        target.database,
        f"UPDATE {table} SET processed_on = NULL, locked_until = NULL, lock_token = NULL, "  # noqa: S608
        "locked_by = NULL WHERE processed_on IS NOT NULL",
    )
    await execute(target.database, f"VACUUM ANALYZE {table}", autocommit=True)
    return Outcome(claimed, elapsed, {"claims": claims})


async def drain_memory(target: Target, size: int, seconds: float) -> Outcome:
    """A worker child drains the filled backlog for ``seconds``; its maximum resident memory."""
    counter = await receiver(target, size, "ticked", pipeline=False)
    relays: list[Child] = []
    try:
        relays = await workers(target, 1)
        started = time.monotonic()
        await relays[0].send("go")
        await asyncio.sleep(seconds)
        await counter.send("count")
        drained = int((await counter.expect("count", 30)).split()[0])
        elapsed = time.monotonic() - started
    finally:
        stats = await stop_all(relays)
        await counter.stop()
        await delete_topology(target, "ticked")
    rss = stats[0]["max_rss_mb"] if stats else float("nan")
    return Outcome(drained, elapsed, {"backlog": size, "max_rss_mb": rss, "workers": stats})


# -- idle ---------------------------------------------------------------------------------------


async def idle_statements(base: Target, *, seconds: float, warmup: float = 5.0) -> Outcome:
    """Statements per second of one worker at default settings against an empty outbox."""
    target = base.fresh()
    await empty_outbox(target.database)
    relays = await workers(target, 1)
    try:
        await relays[0].send("go")
        await asyncio.sleep(warmup)
        samples = []
        for pause in (0.0, seconds):
            await asyncio.sleep(pause)
            await relays[0].send("count")
            statements, stamp = (await relays[0].expect("count", 30)).split()
            samples.append((int(statements), float(stamp)))
    finally:
        stats = await stop_all(relays)
        await delete_topology(target, "ticked")
    (first, at_first), (second, at_second) = samples
    return Outcome(second - first, at_second - at_first, {"workers": stats})


# -- the child processes ----------------------------------------------------------------------------
# The benchmark's child processes: ``python -m bench.actor <role> [--event E] [--expect N]``.
#
# Configuration comes from the environment (``Target.env()``), the protocol is one line at a time:
#
# * ``counter``: a plain FastStream subscription on the very queue (RabbitMQ) or durable consumer
#   (NATS) the relay publishes the bench events to, declared with the service's own topology
#   (``build_transport`` + ``EndpointNames``) but consumed raw: no signature check, no inbox, no
#   handler, only an ack. It counts DISTINCT message ids, prints ``ready`` once subscribed and,
#   when the N-th distinct message arrived, ``done <unix time> <json>`` with the p50/p99 of
#   ``arrival - sent_at`` in milliseconds (and, for keyed events, how many arrived behind a later
#   event of the same key).
# * ``consumer``: the real consume pipeline (signature, context restore, inbox row, handler in a
#   unit of work) through ``container.handlers().consume``; same ``ready`` / ``done`` lines,
#   counting distinct event ids in the handler.
#   Both answer ``count`` with ``count <distinct arrivals> <monotonic>``.
# * ``worker``: the service's worker (what ``python -m <package> worker`` runs: the bus, then the
#   processors, the listener, cleanup and the sampler) with every SQL statement counted through
#   SQLAlchemy's ``before_cursor_execute`` on both engines (main and bookkeeping; the LISTEN
#   connection is raw asyncpg and not counted). It prints ``ready`` with the bus connected, starts
#   the processors on a ``go`` line, answers ``count`` with ``count <statements> <monotonic>``
#   and, on stdin closing or SIGTERM, stops gracefully and prints
#   ``stats {"statements", "seconds", "max_rss_mb"}``.
#
# Every role stops when its stdin closes.


def say(*parts: object) -> None:
    print(*parts, flush=True)


def say_cpu() -> None:
    """Answer ``cpu``: this process's CPU time (the parent takes differences around a window)."""
    say("cpu", f"{time.process_time():.6f}")


class Commands:
    """The lines the parent sends, read once from stdin; ``None`` when it closed stdin."""

    def __init__(self) -> None:
        self._lines: asyncio.Queue[str | None] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    async def open(self) -> Commands:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

        async def pump() -> None:
            while line := await reader.readline():
                await self._lines.put(line.decode().strip())
            await self._lines.put(None)

        self._task = asyncio.create_task(pump())
        return self

    async def next(self) -> str | None:
        return await self._lines.get()


async def until_stopped(commands: Commands, counted: Callable[[], int]) -> None:
    """Return when stdin closes or SIGTERM arrives; answer ``count`` lines meanwhile."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    async def read() -> None:
        while (line := await commands.next()) is not None:
            if line == "count":
                say("count", counted(), f"{time.monotonic():.6f}")
            elif line == "cpu":
                say_cpu()
        stop.set()

    reader = asyncio.create_task(read())
    await stop.wait()
    reader.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await reader


async def ready_until_stopped(counted: Callable[[], int]) -> None:
    """A receiving child's life once subscribed: say ``ready``, then :func:`until_stopped`."""
    commands = await Commands().open()
    say("ready")
    await until_stopped(commands, counted)


STAGES_ENV = "BENCH_STAGES"  # set on the latency scenario's children: they time each stage


def sent_at_of(body: bytes) -> float | None:
    """The ``sent_at`` a bench event carries (taken just before its commit)."""
    try:
        sent_at = json.loads(body).get("sent_at")
    except (ValueError, AttributeError):
        return None
    return float(sent_at) if isinstance(sent_at, (int, float)) else None


class Stages:
    """Milliseconds from each message's commit (its ``sent_at``) to a stage, per stage."""

    def __init__(self) -> None:
        self.ms: dict[str, list[float]] = {}

    def reached(self, stage: str, bodies: Iterable[bytes]) -> None:
        now = time.time()
        found = self.ms.setdefault(stage, [])
        found.extend((now - sent) * 1000 for body in bodies if (sent := sent_at_of(body)) is not None)

    def summary(self) -> dict[str, dict[str, float]]:
        return {
            stage: {"p50_ms": round(percentile(ms, 50), 2), "p99_ms": round(percentile(ms, 99), 2)}
            for stage, ms in self.ms.items()
            if ms
        }


def time_publishes(bus: MessageBus, stages: Stages) -> None:
    """Note when the relay's batches start publishing (claimed and built) and are confirmed."""
    publish_batch = bus.publish_batch

    async def timed(envelopes: Sequence[Envelope], window: int) -> list[PublishResult]:
        stages.reached("publishing", (envelope.body for envelope in envelopes))
        results = await publish_batch(envelopes, window)
        stages.reached("confirmed", (envelope.body for envelope in envelopes))
        return results

    bus.publish_batch = timed  # type: ignore[method-assign]  # the bench wraps the worker's own bus


def time_pickups(pipeline: ConsumePipeline, stages: Stages) -> None:
    """Note when each message reaches the consume pipeline (before its verification)."""
    consume = pipeline.consume

    async def timed(consumer: Consumer[Any], headers: Mapping[str, object], body: bytes) -> ConsumeOutcome:
        stages.reached("picked up", [body])
        return await consume(consumer, headers, body)

    pipeline.consume = timed  # type: ignore[method-assign]  # the bench wraps the consumer's own pipeline


class Tally:
    """Distinct arrivals, their latency, and per-key order; prints ``done`` at ``expect``."""

    def __init__(self, expect: int, stages: Stages | None = None) -> None:
        self.expect = expect
        self.stages = stages
        self.seen: set[str] = set()
        self.latencies_ms: list[float] = []
        self.last_number: dict[str, int] = {}
        self.out_of_order = 0
        self.done = False

    def arrived(self, message_id: str, payload: dict[str, Any]) -> None:
        if message_id in self.seen:
            return
        now = time.time()
        self.seen.add(message_id)
        sent_at = payload.get("sent_at")
        if isinstance(sent_at, (int, float)):
            self.latencies_ms.append((now - sent_at) * 1000)
        key, number = payload.get("aggregate_id"), payload.get("number")
        if isinstance(key, str) and isinstance(number, int):
            if number < self.last_number.get(key, -1):
                self.out_of_order += 1
            self.last_number[key] = max(number, self.last_number.get(key, -1))
        if len(self.seen) >= self.expect and not self.done:
            self.done = True
            summary: dict[str, Any] = {
                "received": len(self.seen),
                "p50_ms": round(percentile(self.latencies_ms, 50), 2),
                "p99_ms": round(percentile(self.latencies_ms, 99), 2),
                "out_of_order": self.out_of_order,
            }
            if self.stages is not None:
                summary["stages"] = self.stages.summary()
            say("done", f"{now:.6f}", json.dumps(summary))


async def counter(settings: ServiceSettings, event: str, expect: int) -> None:
    container = bench_container(settings)
    bus = settings.message_bus
    names = EndpointNames(settings.application.namespace, bus.preserve_default_endpoint_names)
    transport = build_transport(bus, names, container.registry(), container.signer())
    tally = Tally(expect)

    async def ignored(message: BenchTicked | BenchKeyed, uow: UnitOfWork) -> None:
        del message, uow

    consumer: Consumer[Any] = Consumer(COUNTER, EVENT_TYPES[event], ignored)

    async def on_delivery(delivery: BrokerDelivery) -> None:
        await delivery.ack()
        try:
            payload = json.loads(delivery.body)
        except ValueError:
            payload = {}
        tally.arrived(delivery.message_id, payload if isinstance(payload, dict) else {})

    transport.subscribe(consumer, on_delivery)
    await transport.start()
    await transport.start_consuming()
    try:
        await ready_until_stopped(lambda: len(tally.seen))
    finally:
        await transport.close()


async def consumer(settings: ServiceSettings, event: str, expect: int) -> None:
    container = bench_container(settings)
    stages = Stages() if os.environ.get(STAGES_ENV) else None
    if stages is not None:
        time_pickups(container.pipeline(), stages)
    tally = Tally(expect, stages)

    async def handle(message: BenchTicked | BenchKeyed, uow: UnitOfWork) -> None:
        del uow
        tally.arrived(str(message.event_id), message.model_dump(mode="json"))

    container.handlers().consume(COUNTER, EVENT_TYPES[event], handle)
    bus = container.bus()
    await bus.start()
    await bus.start_consuming()
    freeze_start_up_heap()  # as ``outbox worker`` does once started
    try:
        await ready_until_stopped(lambda: len(tally.seen))
    finally:
        await bus.stop()
        await container.database().dispose()


async def worker(settings: ServiceSettings) -> None:
    container = bench_container(settings)
    database = container.database()
    counted = {"statements": 0}

    def count(*_: object) -> None:
        counted["statements"] += 1

    for engine in {database.engine, database.bookkeeping_engine}:
        sa.event.listen(engine.sync_engine, "before_cursor_execute", count)
    stages = Stages() if os.environ.get(STAGES_ENV) else None
    if stages is not None:
        time_publishes(container.bus(), stages)
    await container.bus().start()
    commands = await Commands().open()
    say("ready")
    while (line := await commands.next()) != "go":
        if line is None:
            return  # closed before go
        if line == "cpu":
            say_cpu()
    started = time.monotonic()
    running = container.worker()
    await running.start()
    freeze_start_up_heap()  # as ``outbox worker`` does once started
    try:
        await until_stopped(commands, lambda: counted["statements"])
    finally:
        await running.stop()  # processors first, then the bus
        await database.dispose()
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kilobytes on Linux
    stats: dict[str, Any] = {
        "statements": counted["statements"],
        "seconds": round(time.monotonic() - started, 3),
        "max_rss_mb": round(rss_kb / 1024, 1),
    }
    if stages is not None:
        stats["stages"] = stages.summary()
    say("stats", json.dumps(stats))


def act(argv: list[str]) -> None:
    """A child process: ``python -m outbox_kit.testing.bench actor <role> ...``."""
    parser = argparse.ArgumentParser(description="a benchmark child process")
    parser.add_argument("role", choices=["counter", "consumer", "worker"])
    parser.add_argument("--event", choices=sorted(EVENT_TYPES), default="ticked")
    parser.add_argument("--expect", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    settings = ServiceSettings(_env_file=None)
    if args.role == "counter":
        asyncio.run(counter(settings, args.event, args.expect))
    elif args.role == "consumer":
        asyncio.run(consumer(settings, args.event, args.expect))
    else:
        asyncio.run(worker(settings))


# -- the run and its report -------------------------------------------------------------------------


SECTIONS = ("drain", "e2e", "write", "latency", "backlog", "ordered", "idle")
NAN = float("nan")


@dataclass
class Figure:
    """One line of the table: per-round values against a target."""

    section: str
    label: str
    unit: str  # "x" (a ratio), "ms", "MB" or "stmt/s"
    target: tuple[str, float] | None  # (">=" or "<=", threshold)
    values: list[float] = field(default_factory=list)
    absolute: str = ""
    errors: list[str] = field(default_factory=list)

    @property
    def median(self) -> float:
        return median(self.values)

    @property
    def kept(self) -> list[float]:
        return [v for v in self.values if v == v]  # noqa: PLR0124 (drops NaN)

    @property
    def met(self) -> bool | None:
        value = self.median
        if self.target is None or value != value:  # noqa: PLR0124 (NaN: not measured)
            return None
        op, threshold = self.target
        return value >= threshold if op == ">=" else value <= threshold

    def fmt(self, value: float) -> str:
        if value != value:  # noqa: PLR0124 (NaN)
            return "n/a"
        return f"{value:.2f}x" if self.unit == "x" else f"{value:.1f} {self.unit}"

    def row(self) -> list[str]:
        kept = self.kept
        spread = f"{self.fmt(min(kept))} - {self.fmt(max(kept))}" if len(kept) > 1 else ""
        target = f"{self.target[0]} {self.fmt(self.target[1])}" if self.target else "(info)"
        result = {True: "met", False: "NOT met", None: "" if self.target is None else "not measured"}
        return [self.label, target, self.fmt(self.median), spread, self.absolute, result[self.met]]

    def as_json(self) -> dict[str, Any]:
        return {
            "section": self.section,
            "label": self.label,
            "unit": self.unit,
            "target": list(self.target) if self.target else None,
            "median": None if self.median != self.median else round(self.median, 4),
            "values": [None if v != v else round(v, 4) for v in self.values],  # noqa: PLR0124
            "absolute": self.absolute,
            "met": self.met,
            "errors": self.errors,
        }


class Run:
    """The figures and every raw outcome of one benchmark run."""

    def __init__(self, args: argparse.Namespace, target: Target) -> None:
        self.args = args
        self.target = target
        self.figures: list[Figure] = []
        self.raw: dict[str, list[dict[str, Any]]] = {}

    def figure(self, section: str, label: str, unit: str, target: tuple[str, float] | None = None) -> Figure:
        made = Figure(section, label, unit, target)
        self.figures.append(made)
        return made

    async def measure(
        self, section: str, name: str, round_: int, step: Callable[[], Awaitable[Outcome]]
    ) -> Outcome | None:
        """Run one measurement, log it, keep its raw numbers; None (and the error) on failure."""
        print(f"[{section}] round {round_}: {name} ...", end=" ", flush=True)
        try:
            outcome = await step()
        except Exception as error:
            print(f"FAILED: {type(error).__name__}: {error}")
            if self.args.verbose:
                traceback.print_exc()
            self.raw.setdefault(section, []).append({"round": round_, "name": name, "error": str(error)})
            return None
        print(json.dumps(_brief(outcome.as_json())))
        self.raw.setdefault(section, []).append({"round": round_, "name": name} | outcome.as_json())
        return outcome


def _brief(values: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if k != "workers"}


def ratio(a: Outcome | None, b: Outcome | None) -> float:
    return a.rate / b.rate if a is not None and b is not None and b.rate > 0 else NAN


def rate_of(outcomes: list[Outcome | None]) -> float:
    return median(o.rate if o is not None else NAN for o in outcomes)


def extra_of(outcomes: list[Outcome | None], key: str) -> list[float]:
    return [float(o.extra.get(key, NAN)) if o is not None else NAN for o in outcomes]


# -- sections -----------------------------------------------------------------------------------


async def drain(run: Run) -> None:
    n, target = run.args.messages, run.target
    one = run.figure("drain", "Relay drain, 1 worker / raw publish", "x", (">=", 0.9))
    two = run.figure("drain", "Relay drain, 2 workers / raw publish", "x", (">=", 1.1))
    cpu_one = run.figure("drain", "Relay CPU per row, 1 worker", "µs", ("<=", 250.0))
    cpu_two = run.figure("drain", "Relay CPU per row, 2 workers (both)", "µs")
    cpu_raw = run.figure("drain", "Raw publish CPU per message (FastStream)", "µs")
    raws, ones, twos = [], [], []
    for r in range(1, run.args.rounds + 1):
        raw = await run.measure("drain", "raw publish", r, lambda: raw_publish(target, n))
        w1 = await run.measure("drain", "relay 1 worker", r, lambda: relay_drain(target, n))
        w2 = await run.measure("drain", "relay 2 workers", r, lambda: relay_drain(target, n, processes=2))
        one.values.append(ratio(w1, raw))
        two.values.append(ratio(w2, raw))
        raws.append(raw)
        ones.append(w1)
        twos.append(w2)
    one.absolute = f"{rate_of(ones):.0f} vs {rate_of(raws):.0f} msg/s"
    two.absolute = f"{rate_of(twos):.0f} vs {rate_of(raws):.0f} msg/s"
    cpu_one.values = extra_of(ones, "relay_cpu_us")
    cpu_two.values = extra_of(twos, "relay_cpu_us")
    cpu_raw.values = extra_of(raws, "publish_cpu_us")
    if run.args.no_nats or target.transport == "nats":
        return
    nats = Target(target.database, "nats", URLS["nats"], overrides=target.overrides)
    figure = run.figure("drain", "NATS JetStream drain, 1 worker / raw publish", "x", (">=", 0.7))
    raws, ones = [], []
    for r in range(1, run.args.rounds + 1):
        raw = await run.measure("drain", "NATS raw publish", r, lambda: raw_publish(nats, n))
        w1 = await run.measure("drain", "NATS relay 1 worker", r, lambda: relay_drain(nats, n))
        figure.values.append(ratio(w1, raw))
        raws.append(raw)
        ones.append(w1)
    figure.absolute = f"{rate_of(ones):.0f} vs {rate_of(raws):.0f} msg/s"


async def e2e(run: Run) -> None:
    n, target = run.args.messages, run.target
    figure = run.figure("e2e", "End to end (consume pipeline, inbox) / raw publish", "x", (">=", 0.6))
    cpu = run.figure("e2e", "Consumer CPU per message (pipeline, inbox)", "µs", ("<=", 600.0))
    raws, relays = [], []
    for r in range(1, run.args.rounds + 1):
        raw = await run.measure("e2e", "raw publish", r, lambda: raw_publish(target, n))
        relay = await run.measure(
            "e2e", "relay + consume pipeline", r, lambda: relay_drain(target, n, pipeline=True)
        )
        figure.values.append(ratio(relay, raw))
        raws.append(raw)
        relays.append(relay)
    figure.absolute = f"{rate_of(relays):.0f} vs {rate_of(raws):.0f} msg/s"
    cpu.values = extra_of(relays, "receiver_cpu_us")


async def write(run: Run) -> None:
    target, seconds = run.target, run.args.write_seconds
    # (writers, keyed events per commit: 0 is one keyless event, the ratio's goal)
    for writers, keyed_events, goal in ((1, 0, (">=", 0.9)), (8, 0, None), (1, 3, None)):
        shape = f"{keyed_events} keyed events" if keyed_events else "one event"
        figure = run.figure("write", f"Write, outbox on / off, {writers} writer(s), {shape}", "x", goal)
        ons, offs = [], []
        for r in range(1, run.args.rounds + 1):

            def step(
                *, on: bool, w: int = writers, k: int = keyed_events
            ) -> Callable[[], Awaitable[Outcome]]:
                return lambda: commit_rate(target, writers=w, outbox_on=on, seconds=seconds, keyed_events=k)

            label = f"{writers} writer(s), {shape}"
            on = await run.measure("write", f"outbox on, {label}", r, step(on=True))
            off = await run.measure("write", f"outbox off, {label}", r, step(on=False))
            figure.values.append(ratio(on, off))
            ons.append(on)
            offs.append(off)
        figure.absolute = f"{rate_of(ons):.0f} vs {rate_of(offs):.0f} commits/s"
        if writers == 1:
            on_cpu = run.figure("write", f"Writer CPU per commit of {shape}, outbox on", "µs")
            off_cpu = run.figure("write", f"Writer CPU per commit of {shape}, outbox off", "µs")
            on_cpu.values, off_cpu.values = extra_of(ons, "cpu_us"), extra_of(offs, "cpu_us")
            cost = run.figure(
                "write",
                f"Outbox cost per commit of {shape} (on minus off)",
                "µs",
                (("<=", 100.0) if not keyed_events else None),
            )
            cost.values = [a - b for a, b in zip(on_cpu.values, off_cpu.values, strict=True)]


# p99 from commit to the consumer's handler, worker and consumer in other processes
LATENCY_P99_MS = {100: 15.0}  # issue 35's: p99 <= 15 ms and p50 <= 5 ms at 100/s
LATENCY_P50_MS = {100: 5.0}


async def latency(run: Run) -> None:
    target, seconds = run.target, run.args.latency_seconds
    where = "worker and consumer in other processes"
    for rate in run.args.latency_rates:
        goal = LATENCY_P99_MS.get(rate)
        goal50 = LATENCY_P50_MS.get(rate)
        f50 = run.figure(
            "latency", f"Latency p50 at {rate}/s, {where}", "ms", None if goal50 is None else ("<=", goal50)
        )
        f99 = run.figure(
            "latency", f"Latency p99 at {rate}/s, {where}", "ms", None if goal is None else ("<=", goal)
        )
        outcomes = []
        for r in range(1, run.args.rounds + 1):

            def step(per_second: int = rate) -> Awaitable[Outcome]:
                return steady_latency(target, in_process=False, per_second=per_second, seconds=seconds)

            outcomes.append(await run.measure("latency", f"{rate}/s", r, step))
        f50.values = extra_of(outcomes, "p50_ms")
        f99.values = extra_of(outcomes, "p99_ms")
        # The writer may fall behind the asked rate on a loaded machine: say what it reached.
        f50.absolute = f99.absolute = f"{int(rate * seconds)} events, written at {rate_of(outcomes):.0f}/s"
        for stage in LATENCY_STAGES:
            figure = run.figure("latency", f"  commit to {stage}, p99 at {rate}/s", "ms")
            figure.values = [stage_of(o, stage, "p99_ms") for o in outcomes]
            p50s = [stage_of(o, stage, "p50_ms") for o in outcomes]
            figure.absolute = f"p50 {median(p50s):.1f} ms"


LATENCY_STAGES = ("publishing", "confirmed", "stamped", "picked up", "handled")


def stage_of(outcome: Outcome | None, stage: str, key: str) -> float:
    """One stage's figure of a latency outcome (NaN when not measured)."""
    if outcome is None:
        return NAN
    value = outcome.extra.get("stages", {}).get(stage, {}).get(key)
    return float(value) if isinstance(value, (int, float)) else NAN


async def backlog(run: Run) -> None:
    sizes = sorted(run.args.backlogs)
    rows = min(run.args.claim_rows, sizes[0] // 2)
    claims: dict[int, list[Outcome | None]] = {}
    memory: dict[int, Outcome | None] = {}
    for size in sizes:
        target = run.target.fresh()
        print(f"[backlog] filling {size} pending rows ...", flush=True)
        started = time.monotonic()
        try:
            await fill_backlog(target, size)
        except Exception as error:
            print(f"[backlog] fill failed: {type(error).__name__}: {error}")
            continue
        print(f"[backlog] filled in {time.monotonic() - started:.1f} s", flush=True)
        claim = functools.partial(claim_rate, target, rows)
        claims[size] = [
            await run.measure("backlog", f"claim {rows} rows of {size}", r, claim)
            for r in range(1, run.args.rounds + 1)
        ]
        if size in {sizes[0], sizes[-1]}:
            drained = functools.partial(drain_memory, target, size, run.args.drain_seconds)
            name = f"worker draining {size} for {run.args.drain_seconds:.0f} s"
            memory[size] = await run.measure("backlog", name, 1, drained)
        await empty_outbox(target.database)
    small, large = sizes[0], sizes[-1]
    figure = run.figure("backlog", f"Claim throughput, {large:,} / {small:,} pending", "x", (">=", 0.9))
    figure.values = [
        ratio(b, a) for a, b in zip(claims.get(small, []), claims.get(large, []), strict=False)
    ] or [NAN]
    figure.absolute = ", ".join(f"{size:,}: {rate_of(found):.0f} rows/s" for size, found in claims.items())
    rss = run.figure("backlog", f"Worker memory growth, {small:,} to {large:,} pending", "MB", ("<=", 50.0))
    low, high = memory.get(small), memory.get(large)
    if low is not None and high is not None:
        rss.values = [float(high.extra["max_rss_mb"]) - float(low.extra["max_rss_mb"])]
        rss.absolute = f"max RSS {low.extra['max_rss_mb']} -> {high.extra['max_rss_mb']} MB"
    else:
        rss.values = [NAN]


async def ordered(run: Run) -> None:
    n, target = run.args.messages, run.target
    keyed_ratio = run.figure("ordered", "Ordered drain, 100 keys / keyless, 1 worker", "x", (">=", 0.8))
    scaling = run.figure("ordered", "Ordered drain, 100 keys, 2 workers / 1 worker", "x", (">=", 1.3))
    keyless, ones, twos = [], [], []
    for r in range(1, run.args.rounds + 1):
        a = await run.measure("ordered", "keyless 1 worker", r, lambda: relay_drain(target, n))
        b = await run.measure("ordered", "100 keys 1 worker", r, lambda: relay_drain(target, n, keyed=True))
        c = await run.measure(
            "ordered",
            "100 keys 2 workers",
            r,
            lambda: relay_drain(target, n, keyed=True, processes=2),
        )
        keyed_ratio.values.append(ratio(b, a))
        scaling.values.append(ratio(c, b))
        keyless.append(a)
        ones.append(b)
        twos.append(c)
    keyed_ratio.absolute = f"{rate_of(ones):.0f} vs {rate_of(keyless):.0f} msg/s"
    scaling.absolute = f"{rate_of(twos):.0f} vs {rate_of(ones):.0f} msg/s"
    disorder = sum(int(o.extra.get("out_of_order", 0)) for o in ones + twos if o is not None)
    if disorder:
        print(f"[ordered] WARNING: {disorder} keyed messages arrived behind a later one of their key")


async def idle(run: Run) -> None:
    figure = run.figure(
        "idle", "Idle statements per second, 1 worker, default settings", "stmt/s", ("<=", 1.0)
    )
    outcome = await run.measure(
        "idle", "idle worker", 1, lambda: idle_statements(run.target, seconds=run.args.idle_seconds)
    )
    figure.values = [outcome.rate if outcome is not None else NAN]
    if outcome is not None:
        figure.absolute = f"{outcome.count} statements in {outcome.seconds:.0f} s"


RUNNERS: dict[str, Callable[[Run], Awaitable[None]]] = {
    "drain": drain,
    "e2e": e2e,
    "write": write,
    "latency": latency,
    "backlog": backlog,
    "ordered": ordered,
    "idle": idle,
}

# -- report -------------------------------------------------------------------------------------

HEADER = ["Figure", "Target", "Median", "Range", "Absolute (medians)", "Result"]


def without_password(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


async def machine(run: Run) -> dict[str, Any]:
    try:
        version = await server_version(run.target)
    except Exception as error:
        version = f"unknown ({error})"
    return {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "postgresql": version,
        "transport": run.target.transport,
        "broker": without_password(run.target.url),
        "database": without_password(run.target.database),
    }


def settings_used(target: Target) -> dict[str, Any]:
    settings = target.settings()
    return {
        "outbox": settings.outbox.model_dump(mode="json"),
        "database_pool_size": settings.database.pool_size,
        "publish_timeout_seconds": settings.message_bus.publish_timeout_seconds,
        "overrides": target.overrides,
    }


def table(figures: list[Figure]) -> list[list[str]]:
    return [HEADER, *(figure.row() for figure in figures)]


def print_table(figures: list[Figure]) -> None:
    rows = table(figures)
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER))]
    for index, row in enumerate(rows):
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
        if index == 0:
            print("  ".join("-" * width for width in widths))


def markdown(run: Run, info: dict[str, Any], when: str) -> str:
    outbox = settings_used(run.target)["outbox"]
    lines = [
        (
            f"Measured {when} on {info['platform']} ({info['cpu_count']} CPUs), Python {info['python']}, "
            f"PostgreSQL {info['postgresql']}, transport {info['transport']}."
        ),
        (
            f"Settings: batch size {outbox['batch_size']}, delivery concurrency "
            f"{outbox['delivery_concurrency']}, polling interval {outbox['polling_interval_seconds']} s"
            + (f", overrides {run.target.overrides}" if run.target.overrides else "")
            + f"; {run.args.messages:,} messages per drain, {run.args.rounds} round(s), median (range)."
        ),
        "",
    ]
    rows = table(run.figures)
    lines.append("| " + " | ".join(rows[0]) + " |")
    lines.append("|" + "|".join("---" for _ in rows[0]) + "|")
    lines.extend("| " + " | ".join(cell or " " for cell in row) + " |" for row in rows[1:])
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench", description=(__doc__ or "").splitlines()[0], epilog="see bench/__main__.py"
    )
    parser.add_argument("--database", default=DEFAULT_DATABASE, help="PostgreSQL URL (asyncpg)")
    parser.add_argument("--transport", default="rabbitmq", choices=["rabbitmq", "nats", "redis"])
    parser.add_argument("--broker-url", default="", help="the transport's URL (its local default if empty)")
    parser.add_argument("--no-nats", action="store_true", help="skip the NATS figures of the drain")
    parser.add_argument("--messages", type=int, default=20_000, help="rows per drain")
    parser.add_argument("--rounds", type=int, default=3, help="A B A B repetitions")
    parser.add_argument(
        "--backlogs",
        type=lambda text: [int(size) for size in text.split(",")],
        default=[10_000, 100_000, 1_000_000],
        help="pending rows for the backlog section (comma-separated)",
    )
    parser.add_argument("--claim-rows", type=int, default=20_000, help="rows claimed per backlog round")
    parser.add_argument("--drain-seconds", type=float, default=20.0, help="backlog drain time for RSS")
    parser.add_argument("--write-seconds", type=float, default=5.0, help="time per commit-rate figure")
    parser.add_argument(
        "--latency-rates",
        type=lambda text: [int(rate) for rate in text.split(",")],
        default=[100, 200],
        help="events per second of the latency figures (comma-separated)",
    )
    parser.add_argument("--latency-seconds", type=float, default=10.0, help="time per latency figure")
    parser.add_argument("--idle-seconds", type=float, default=30.0, help="idle sampling time")
    parser.add_argument(
        "--only",
        type=lambda text: [s.strip() for s in text.split(",") if s.strip()],
        default=list(SECTIONS),
        help=f"sections to run, comma-separated: {','.join(SECTIONS)}",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION__KEY=VALUE",
        help="a service setting for every process, e.g. OUTBOX__BATCH_SIZE=100 (repeatable)",
    )
    parser.add_argument("--json", default="bench-results.json", help="results file ('' for none)")
    parser.add_argument("--markdown", default="bench-results.md", help="table file ('' for none)")
    parser.add_argument("--verbose", action="store_true", help="print tracebacks of failed figures")
    args = parser.parse_args(argv)
    unknown = [s for s in args.only if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    bad = [o for o in args.overrides if "=" not in o or "__" not in o.partition("=")[0]]
    if bad:
        parser.error(f"--set takes SECTION__KEY=VALUE, not {', '.join(bad)}")
    return args


async def measure(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    overrides = {o.partition("=")[0].upper(): o.partition("=")[2] for o in args.overrides}
    target = Target(
        args.database, args.transport, args.broker_url or URLS[args.transport], overrides=overrides
    )
    run = Run(args, target)
    when = datetime.now(UTC).isoformat(timespec="seconds")
    await prepare(target)
    info = await machine(run)
    print(f"bench: {info['platform']}, {info['cpu_count']} CPUs, PostgreSQL {info['postgresql']}")
    print(f"bench: {target.transport} at {without_password(target.url)}, database {info['database']}")
    for section in SECTIONS:
        if section in args.only:
            await RUNNERS[section](run)
    print()
    print_table(run.figures)
    report = {
        "when": when,
        "machine": info,
        "settings": settings_used(target),
        "arguments": {k: v for k, v in vars(args).items() if k not in {"json", "markdown", "verbose"}},
        "figures": [figure.as_json() for figure in run.figures],
        "rounds": run.raw,
    }
    return report, markdown(run, info, when)


def main(argv: list[str] | None = None) -> int:
    """``python -m outbox_kit.testing.bench [options]``, or a child: ``... actor <role>``."""
    arguments = sys.argv[1:] if argv is None else argv
    if arguments[:1] == ["actor"]:
        act(arguments[1:])
        return 0
    args = parse_args(arguments)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    for name in ("faststream", "faststream.access"):  # the in-process worker's subscriber notes
        logging.getLogger(name).setLevel(logging.WARNING)
    report, table_text = asyncio.run(measure(args))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        print(f"\nresults: {args.json}")
    if args.markdown:
        Path(args.markdown).write_text(table_text, encoding="utf-8")
        print(f"table: {args.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
