"""The benchmark's child processes: ``python -m bench.actor <role> [--event E] [--expect N]``.

Configuration comes from the environment (``Target.env()``), the protocol is one line at a time:

* ``counter``: a plain FastStream subscription on the very queue (RabbitMQ) or durable consumer
  (NATS) the relay publishes the bench events to, declared with the service's own topology
  (``build_transport`` + ``EndpointNames``) but consumed raw: no signature check, no inbox, no
  handler, only an ack. It counts DISTINCT message ids, prints ``ready`` once subscribed and,
  when the N-th distinct message arrived, ``done <unix time> <json>`` with the p50/p99 of
  ``arrival - sent_at`` in milliseconds (and, for keyed events, how many arrived behind a later
  event of the same key).
* ``consumer``: the real consume pipeline (signature, context restore, inbox row, handler in a
  unit of work) through ``container.handlers().consume``; same ``ready`` / ``done`` lines,
  counting distinct event ids in the handler.
  Both answer ``count`` with ``count <distinct arrivals> <monotonic>``.
* ``worker``: the service's worker (what ``python -m <package> worker`` runs: the bus, then the
  processors, the listener, cleanup and the sampler) with every SQL statement counted through
  SQLAlchemy's ``before_cursor_execute`` on both engines (main and bookkeeping; the LISTEN
  connection is raw asyncpg and not counted). It prints ``ready`` with the bus connected, starts
  the processors on a ``go`` line, answers ``count`` with ``count <statements> <monotonic>``
  and, on stdin closing or SIGTERM, stops gracefully and prints
  ``stats {"statements", "seconds", "max_rss_mb"}``.

Every role stops when its stdin closes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import resource
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from outbox_kit.application.handlers import Consumer
from outbox_kit.application.unit_of_work import (
    UnitOfWork,
)
from outbox_kit.consume.bus import (
    build_transport,
)
from outbox_kit.transports.base import (
    BrokerDelivery,
)
from outbox_kit.transports.settings import (
    EndpointNames,
)

from {{ cookiecutter.package_name }}.settings import (
    Settings,
)

from .common import COUNTER, EVENT_TYPES, BenchKeyed, BenchTicked, bench_container, percentile


def say(*parts: object) -> None:
    print(*parts, flush=True)


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
        stop.set()

    reader = asyncio.create_task(read())
    await stop.wait()
    reader.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await reader


class Tally:
    """Distinct arrivals, their latency, and per-key order; prints ``done`` at ``expect``."""

    def __init__(self, expect: int) -> None:
        self.expect = expect
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
            summary = {
                "received": len(self.seen),
                "p50_ms": round(percentile(self.latencies_ms, 50), 2),
                "p99_ms": round(percentile(self.latencies_ms, 99), 2),
                "out_of_order": self.out_of_order,
            }
            say("done", f"{now:.6f}", json.dumps(summary))


async def counter(settings: Settings, event: str, expect: int) -> None:
    container = bench_container(settings)
    bus = settings.message_bus
    names = EndpointNames(settings.application.namespace, bus.preserve_default_endpoint_names)
    transport = build_transport(bus, names, container.registry())
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
    await transport.connect()
    await transport.declare([consumer])
    await transport.start_consuming()
    commands = await Commands().open()
    say("ready")
    try:
        await until_stopped(commands, lambda: len(tally.seen))
    finally:
        await transport.close()


async def consumer(settings: Settings, event: str, expect: int) -> None:
    container = bench_container(settings)
    tally = Tally(expect)

    async def handle(message: BenchTicked | BenchKeyed, uow: UnitOfWork) -> None:
        del uow
        tally.arrived(str(message.event_id), message.model_dump(mode="json"))

    container.handlers().consume(COUNTER, EVENT_TYPES[event], handle)
    bus = container.bus()
    await bus.start()
    await bus.start_consuming()
    commands = await Commands().open()
    say("ready")
    try:
        await until_stopped(commands, lambda: len(tally.seen))
    finally:
        await bus.stop()
        await container.database().dispose()


async def worker(settings: Settings) -> None:
    container = bench_container(settings)
    database = container.database()
    counted = {"statements": 0}

    def count(*_: object) -> None:
        counted["statements"] += 1

    for engine in {database.engine, database.bookkeeping_engine}:
        sa.event.listen(engine.sync_engine, "before_cursor_execute", count)
    await container.bus().start()
    commands = await Commands().open()
    say("ready")
    while (line := await commands.next()) != "go":
        if line is None:
            return  # closed before go
    started = time.monotonic()
    running = container.worker()
    await running.start()
    try:
        await until_stopped(commands, lambda: counted["statements"])
    finally:
        await running.stop()  # processors first, then the bus
        await database.dispose()
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kilobytes on Linux
    stats = {
        "statements": counted["statements"],
        "seconds": round(time.monotonic() - started, 3),
        "max_rss_mb": round(rss_kb / 1024, 1),
    }
    say("stats", json.dumps(stats))


def main() -> None:
    parser = argparse.ArgumentParser(description="a benchmark child process (see bench/actor.py)")
    parser.add_argument("role", choices=["counter", "consumer", "worker"])
    parser.add_argument("--event", choices=sorted(EVENT_TYPES), default="ticked")
    parser.add_argument("--expect", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    settings = Settings(_env_file=None)
    if args.role == "counter":
        asyncio.run(counter(settings, args.event, args.expect))
    elif args.role == "consumer":
        asyncio.run(consumer(settings, args.event, args.expect))
    else:
        asyncio.run(worker(settings))


if __name__ == "__main__":
    main()
