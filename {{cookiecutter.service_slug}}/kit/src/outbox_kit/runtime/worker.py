"""The background half of the service: processors, consumers, listener, cleanup, sampler.

``start()`` launches everything as tasks; ``stop()`` (SIGTERM) cancels them all (an in-flight
outcome is still written within the shutdown timeout, see ``processor.cycle``), waits at most that
long (and a second), then closes the bus."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine, Sequence
from itertools import groupby
from typing import Any

import sqlalchemy as sa

from outbox_kit.application.clock import Clock
from outbox_kit.application.metrics import RelayMetrics
from outbox_kit.operations.retention import RetentionCleaner
from outbox_kit.persistence.database import Database
from outbox_kit.persistence.writer import WakeSignal
from outbox_kit.processor.cycle import TableSource
from outbox_kit.processor.processor import PostgresListener, Processor
from outbox_kit.transports.bus import MessageBus

log = logging.getLogger(__name__)


def database_of(table: TableSource) -> Database:
    return table.database


class Worker:
    """Owns the background tasks of one process."""

    def __init__(
        self,
        *,
        sources: Sequence[TableSource],
        wake: WakeSignal,
        cleaners: Sequence[RetentionCleaner],
        bus: MessageBus,
        metrics: RelayMetrics,
        clock: Clock,
        listeners: Sequence[PostgresListener],
        polling_interval_seconds: float,
        idle_polling_interval_seconds: float,
        cleanup_interval_seconds: float,
        metrics_interval_seconds: float,
        shutdown_timeout_seconds: float,
        liveness_timeout_seconds: float = 600.0,
    ) -> None:
        self._sources = sources
        self._wake = wake
        self._cleaners = cleaners
        self._bus = bus
        self._metrics = metrics
        self._clock = clock
        self._listeners = listeners
        self._interval = polling_interval_seconds
        self._idle_interval = idle_polling_interval_seconds
        self._cleanup_interval = cleanup_interval_seconds
        self._metrics_interval = metrics_interval_seconds
        self._shutdown_timeout = shutdown_timeout_seconds
        self._liveness_timeout = liveness_timeout_seconds
        self._loops: list[asyncio.Task[None]] = []
        self._others: list[asyncio.Task[None]] = []
        self.polling_loops: list[Processor] = []
        self._turning: list[tuple[Processor, asyncio.Task[None]]] = []

    def _spawn(
        self, coroutine: Coroutine[Any, Any, None], name: str, group: list[asyncio.Task[None]]
    ) -> None:
        task = asyncio.create_task(coroutine, name=name)
        task.add_done_callback(self._report_crash)
        group.append(task)

    @staticmethod
    def _report_crash(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("background task %s died", task.get_name(), exc_info=task.exception())

    async def start(self) -> None:
        for source in self._sources:
            loop = Processor(
                source,
                wake=self._wake.subscribe(),
                interval_seconds=self._interval,
                clock=self._clock,
                idle_interval_seconds=self._idle_interval,
                wake_is_reliable=self._listening,
            )
            self.polling_loops.append(loop)
            self._spawn(loop.run(), f"poll:{source.name}", self._loops)
            self._turning.append((loop, self._loops[-1]))
        for number, listener in enumerate(self._listeners):
            self._spawn(listener.run(), f"listen:postgres:{number}", self._others)
        for number, cleaner in enumerate(self._cleaners):
            self._spawn(cleaner.run(self._cleanup_interval), f"cleanup:{number}", self._others)
        self._spawn(self._sample_depth(), "metrics:pending", self._others)
        await self._bus.start_consuming()
        log.info("worker started: %s", ", ".join(s.name for s in self._sources) or "no processors")

    def stalled(self) -> list[str]:
        """The processor loops that stopped turning: their task ended (it never should before
        ``stop``), or no cycle began or ended within the liveness timeout (a hung cycle).
        ``/livez`` fails while this is not empty, so the orchestrator restarts the process.

        A cycle that fails (the database is down) still turns the loop: an outage is for
        ``/readyz`` to report, and restarting a worker would not end it."""
        now = time.monotonic()
        stalled = []
        for loop, task in self._turning:
            silent = now - loop.last_turn
            if task.done():
                stalled.append(f"{loop.source.name}: its loop ended")
            elif silent > self._liveness_timeout:
                stalled.append(f"{loop.source.name}: no turn for {silent:.0f} s")
        return stalled

    def _listening(self) -> bool:
        """Every commit wakes this process (a LISTEN connection is up on every database)."""
        return bool(self._listeners) and all(listener.connected.is_set() for listener in self._listeners)

    async def stop(self) -> None:
        """Every task cancelled at once; the processor loops get the shutdown timeout to write
        their in-flight outcomes (each cycle has that deadline, see ``processor.cycle``) and a
        second to unwind; then the bus is closed (the processors' publishes needed it).

        A task still running then (a statement stuck on a silent database line) is left behind
        and logged, never waited for: the process's own deadline ends what is left."""
        self._turning.clear()
        tasks = [*self._loops, *self._others]
        for task in tasks:
            task.cancel()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self._shutdown_timeout + 1)
            if pending:
                log.warning(
                    "shutdown: %s still running after %g s; left behind",
                    ", ".join(sorted(task.get_name() for task in pending)),
                    self._shutdown_timeout + 1,
                )
        self._loops.clear()
        self._others.clear()
        with contextlib.suppress(Exception):
            await self._bus.stop()
        log.info("worker stopped")

    async def sample_depth(self) -> None:
        """Set ``outbox_pending_depth`` from the tables (leased rows included, dead letters not),
        one session per source. A source that does not answer keeps its last values; the others
        are still sampled."""
        failed: list[str] = []
        for database, tables in groupby(self._sources, key=database_of):
            polled = list(tables)
            try:
                async with database.session() as session:
                    for source in polled:
                        c = source.table.c
                        pending = sa.select(sa.func.count()).where(
                            c.processed_on.is_(None), c.dead_lettered_on.is_(None)
                        )
                        count = (await session.exec(pending)).scalar_one()  # type: ignore[call-overload]
                        self._metrics.pending_depth.labels(source.name).set(count)
            except Exception:  # noqa: BLE001 (reported below; the other sources go on)
                failed += [source.name for source in polled]
        if failed:
            msg = f"no pending depth for {', '.join(failed)}"
            raise RuntimeError(msg)

    async def _sample_depth(self) -> None:
        while True:
            try:
                await self.sample_depth()
            except Exception:
                log.warning("could not sample the pending depth", exc_info=True)
            await asyncio.sleep(self._metrics_interval)
