"""One worker process of the real service, as the conformance scenarios start it
(``python -m tests.reliability.service_actor --db URL --transport rabbitmq ...``).

It is the service's own ``worker`` command (``run_worker``: processors, consumers, the LISTEN
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
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from outbox_kit.application.context import (
    RequestContext,
    current_context,
    use_context,
)
from outbox_kit.application.observability import TimeLimit
from outbox_kit.persistence.unit_of_work import (
    SqlUnitOfWork,
)
from outbox_kit.processor.claim import ClaimedRow
from outbox_kit.processor.cycle import (
    TableSource,
)
from outbox_kit.runtime.server import run_worker
from outbox_kit.testing.fixtures import longest_delivery, make_settings
from outbox_kit.testing.harness import (
    CONSUMER,
    DELIVERIES,
    RECEIVED,
    Counter,
    CounterChangedV1,
    Counters,
    Noted,
    install_kit,
)
from outbox_kit.transports.bus import Delivered

from {{ cookiecutter.package_name }}.container import Container, build_container

LEDGER = CONSUMER  # the hostile-message helpers of the broker tests read this consumer's letters
RELAY_POISON = -1  # an event whose publish fails while the poison file exists
HANDLER_POISON = -7777  # an event whose consumer handler always fails (dead-lettered by the bus)
CRASHED_AFTER_PUBLISH = 9  # the exit status of --crash-after-publish


async def record_receipt(
    uow: SqlUnitOfWork, worker: str, label: str, value: int, ordering_key: str | None
) -> None:
    """The effect of a handler here: what it saw, under which caller, in its unit of work."""
    context = current_context()
    await uow.session.exec(  # type: ignore[call-overload]
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


def ledger_handler(worker: str) -> Callable[[CounterChangedV1, SqlUnitOfWork], Awaitable[None]]:
    async def handler(event: CounterChangedV1, uow: SqlUnitOfWork) -> None:
        if event.value == HANDLER_POISON:
            msg = "a handler that fails on this message every time"
            raise RuntimeError(msg)
        await record_receipt(uow, worker, event.counter_id, event.value, event.aggregate_id)

    return handler


def noted_handler(
    container: Container, process: str, seconds: float
) -> Callable[[Noted, SqlUnitOfWork], Awaitable[None]]:
    """A local domain-event handler that takes ``seconds``: its start is recorded in a
    transaction of its own (kept even if the process dies mid-handler), its effect in the
    handler's unit of work (kept only if the delivery commits)."""

    async def record_start(text: str) -> None:
        async with container.database().session() as session:
            await session.exec(  # type: ignore[call-overload]
                sa.insert(DELIVERIES).values(
                    row_id=text, seq=0, processor=process, token="-", delivered_at=time.time()
                )
            )
            await session.commit()

    async def handler(event: Noted, uow: SqlUnitOfWork) -> None:
        # The test's own record, outside the handler's scope (the service refuses a handler
        # that commits: see the architecture tests), so it survives the process's death.
        await asyncio.create_task(record_start(event.text), context=contextvars.Context())
        print(f"handling {event.text}", flush=True)
        await asyncio.sleep(seconds)
        await record_receipt(uow, process, event.text, 0, None)

    return handler


def build(args: argparse.Namespace) -> Container:
    return build_container(
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
                "publish_timeout_seconds": min(10.0, longest_delivery(args.lease) / 2),
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


class Faults:
    """The injected faults of one process, wrapped around the real outbox deliverer."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.crash_after = args.crash_after_publish
        self.poison_file = Path(args.poison_file) if args.poison_file else None
        self.published = 0
        self.after_publish = args.after_publish_seconds

    def wrap(self, deliver: Callable[[ClaimedRow, uuid.UUID, TimeLimit], Awaitable[Delivered]]) -> Any:
        async def faulty(row: ClaimedRow, token: uuid.UUID, limit: TimeLimit) -> Delivered:
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


class ProcessFigures:
    """Claims counted per process, written with the service's metrics to the status file."""

    def __init__(self, container: Container, path: Path | None) -> None:
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
    deliverer.deliver = Faults(args).wrap(deliverer.deliver)  # type: ignore[method-assign]
    figures = ProcessFigures(container, Path(args.status) if args.status else None)
    for source in container.sources():
        if source.name == "outbox":
            figures.count_claims(source)
    status = asyncio.create_task(figures.write_every(0.2))
    try:
        await run_worker(container)
    finally:
        status.cancel()
        orphaned.cancel()
        if figures.path is not None:
            figures.path.write_text(json.dumps(figures.snapshot()))
    print("stopped", flush=True)


async def commit_notes(container: Container, args: argparse.Namespace) -> None:
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
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
    parser.add_argument("--status", default="")
    parser.add_argument(
        "--commits", type=int, default=0, help="be an API process: commit this often, then exit"
    )
    parser.add_argument("--handler-seconds", type=float, default=0.0)
    parser.add_argument("--processing-delay", type=float, default=5.0)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    asyncio.run(work(args))


if __name__ == "__main__":
    main()
