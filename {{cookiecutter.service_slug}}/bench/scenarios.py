"""One function per measurement. Each uses a fresh namespace (so fresh queues, streams and
consumers), starts from an emptied outbox, and removes its broker topology afterwards.

* :func:`raw_publish`: the ceiling. N messages prebuilt exactly as the relay builds them (same
  body, same signed headers, same message ids shape) are published through the transport's own
  FastStream ``publish`` (RabbitMQ: persistent, mandatory, publisher-confirmed, to the service's
  topic exchange; NATS: JetStream publish with ``Nats-Msg-Id``), 64 in flight (a semaphore and
  ``gather``). Timed from the first publish to the counting child's N-th distinct arrival.
* :func:`relay_drain`: N rows committed by the real unit of work first (not timed), then the
  counting child (or the real consumer with ``pipeline=True``) and one or two worker processes
  are started and wait; timed from ``go`` to the N-th distinct arrival.
* :func:`commit_rate`: commits per second of a small command (one row into ``bench_tallies``
  plus, when the outbox is on, one integration event enqueued on the same unit of work) for a
  fixed time, with 1 or N concurrent writers. "Outbox off" is the same unit of work and the same
  enqueue with ``MESSAGE_BUS__ENABLE_OUTBOX=false`` on the in-process transport (the only
  transport that allows it): the event is handed to the in-process bus after the commit instead
  of becoming a row.
* :func:`latency`: one event per commit at a steady rate; the real consumer child reports the
  p50/p99 of ``handler time - sent_at`` (``sent_at`` is taken just before the commit). The worker
  runs in this process (woken in-process by the commit) or in a child (woken by NOTIFY).
* :func:`fill_backlog` + :func:`claim_rate` + :func:`drain_memory`: ``size`` pending rows made
  server-side from one row the unit of work wrote (``INSERT ... SELECT ... generate_series``,
  new ids), ``VACUUM ANALYZE``; then the relay's own claim (``TableSource.claim``) and processed
  stamp (``LeaseStore.stamp_processed``) are called in a loop for a fixed number of rows
  (rows/s), and the claimed rows are put back pending between rounds; then a worker child
  drains the backlog for a fixed time and reports its maximum resident memory.
* :func:`idle_statements`: a worker child at default settings against an empty outbox;
  statements per second between two ``count`` samples taken after a warm-up.

Nothing here asserts a timing: the caller compares figures with the issue's targets.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from outbox_kit.application.context import (
    capture_context,
    use_context,
)
from outbox_kit.application.unit_of_work import (
    UnitOfWork,
)
from outbox_kit.consume.bus import (
    FastStreamBus,
    build_transport,
)
from outbox_kit.persistence.tables import (
    OUTBOX_TABLE,
)
from outbox_kit.runtime import cli
from outbox_kit.transports.envelope import (
    Envelope,
)
from outbox_kit.transports.settings import (
    EndpointNames,
)

from {{ cookiecutter.package_name }}.__main__ import PROJECT_ROOT
from {{ cookiecutter.package_name }}.container import (
    Container,
)

from .common import (
    BENCH_CONTEXT,
    COUNTER,
    EVENT_TYPES,
    BenchKeyed,
    BenchTicked,
    Child,
    Target,
    bench_container,
    empty_outbox,
    execute,
    make_events,
    ticked,
    write_events,
)

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


def drain_timeout(count: int) -> float:
    return max(120.0, count / 20)


async def create_missing_database(url: str) -> None:
    """Create the bench's PostgreSQL database when the server does not have it yet."""
    import asyncpg  # noqa: PLC0415 (PostgreSQL only)

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
    """Create (when missing) and migrate the bench database, and create the bench's own table."""
    if target.database.startswith("postgresql"):
        await create_missing_database(target.database)
    await asyncio.to_thread(cli.upgrade, PROJECT_ROOT, target.database)
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
        if isinstance(bus, FastStreamBus):
            await bus.delete_topology()
    except Exception as error:  # noqa: BLE001 (cleanup must not hide the figure)
        print(f"  (could not delete the topology of {target.namespace}: {error})")
    finally:
        await container.database().dispose()


async def receiver(target: Target, count: int, event: str, *, pipeline: bool) -> Child:
    """The counting child (raw) or the real consumer (pipeline), subscribed and ready."""
    role = "consumer" if pipeline else "counter"
    child = await Child(role, ["--event", event, "--expect", str(count)], target.env()).start()
    try:
        await child.expect("ready", 60)
    except BaseException:
        await child.stop()
        raise
    return child


def parse_done(rest: str) -> tuple[float, dict[str, Any]]:
    stamp, _, summary = rest.partition(" ")
    return float(stamp), json.loads(summary)


async def workers(target: Target, processes: int, **sections: dict[str, Any]) -> list[Child]:
    started: list[Child] = []
    try:
        for _ in range(processes):
            child = Child("worker", [], target.env(**sections))
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


def prebuilt(container: Container, count: int, *, keys: int) -> list[tuple[Envelope, dict[str, str]]]:
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
    """FastStream publishing ``count`` relay-shaped messages, 64 in flight, to the counter."""
    target = base.fresh()
    event = "keyed" if keyed else "ticked"
    settings = target.settings()
    container = bench_container(settings)
    bus = settings.message_bus
    names = EndpointNames(settings.application.namespace, bus.preserve_default_endpoint_names)
    transport = build_transport(bus, names, container.registry())
    messages = prebuilt(container, count, keys=KEYS if keyed else 0)
    counter = await receiver(target, count, event, pipeline=False)
    try:
        await transport.connect()
        gate = asyncio.Semaphore(IN_FLIGHT)

        async def publish(envelope: Envelope, headers: dict[str, str]) -> None:
            async with gate:
                await transport.publish(envelope, headers)

        started = time.time()
        await asyncio.gather(*(publish(envelope, headers) for envelope, headers in messages))
        published = time.time()
        finished, summary = parse_done(await counter.expect("done", drain_timeout(count)))
        return Outcome(
            count, finished - started, {"publish_seconds": round(published - started, 4)} | summary
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
        started = time.time()
        for child in relays:
            await child.send("go")
        finished, summary = parse_done(await counter.expect("done", drain_timeout(count)))
        outcome = Outcome(count, finished - started, summary)
    finally:
        stats = await stop_all(relays)
        await counter.stop()
        await delete_topology(target, event)
        await empty_outbox(target.database)
    outcome.extra["workers"] = stats
    return outcome


# -- the write path -----------------------------------------------------------------------------


async def commit_rate(base: Target, *, writers: int, outbox_on: bool, seconds: float) -> Outcome:
    """Commits per second of a one-row command (+ one enqueued event), ``writers`` at once."""
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

    async def command(writer: int, number: int) -> None:
        async with units() as uow:
            await uow.session.execute(sa.text(insert), {"writer": writer, "number": number})
            uow.enqueue(ticked(number))
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
            started = time.monotonic()
            await asyncio.gather(*(write(w, started + seconds) for w in range(writers)))
            elapsed = time.monotonic() - started
    finally:
        await container.database().dispose()
        await empty_outbox(target.database)
        await execute(target.database, f"TRUNCATE {TALLIES}")
    return Outcome(sum(commits), elapsed, {"writers": writers, "outbox": outbox_on})


# -- latency ------------------------------------------------------------------------------------


async def latency(base: Target, *, in_process: bool, per_second: int, seconds: float) -> Outcome:
    """p50/p99 from commit to the real consumer's handler at a steady ``per_second``."""
    target = base.fresh()
    count = int(per_second * seconds)
    await empty_outbox(target.database)
    container = bench_container(target.settings())
    consumer = await receiver(target, count, "ticked", pipeline=True)
    relays: list[Child] = []
    running = False
    try:
        if in_process:
            await container.bus().start()
            await container.worker().start()
            running = True
        else:
            relays = await workers(target, 1)
            await relays[0].send("go")
        await asyncio.sleep(1.0)  # the first (empty) claim and the LISTEN connection
        units = container.units_of_work()
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
        outcome = Outcome(count, written, summary | {"in_process": in_process, "per_second": per_second})
    finally:
        if running:
            await container.worker().stop()
        await stop_all(relays)
        await consumer.stop()
        await container.database().dispose()
        await delete_topology(target, "ticked")
        await empty_outbox(target.database)
    return outcome


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
