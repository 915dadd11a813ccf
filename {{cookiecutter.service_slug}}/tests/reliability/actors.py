"""The processes the reliability tests start (``python -m tests.reliability.actors <role>``).

Each actor builds the real service container on the given database and records what it did in
the kit's ``kit_deliveries`` table, in its own committed transaction, before it reports success:
so a duplicate delivery, a lost row or an order violation is visible after the fact.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path

import sqlalchemy as sa
from outbox_kit.application.context import (
    CapturedContext,
)
from outbox_kit.application.observability import (
    SpanKind,
    TimeLimit,
    system_clock,
)
from outbox_kit.persistence.tables import (
    OUTBOX_TABLE,
)
from outbox_kit.persistence.unit_of_work import (
    SqlUnitOfWork,
    WakeSignal,
)
from outbox_kit.processor.claim import ClaimedRow
from outbox_kit.processor.cycle import (
    TableSource,
)
from outbox_kit.processor.processor import (
    Processor,
    SourceSettings,
)
from outbox_kit.runtime.container import build_listener, source_settings
from outbox_kit.testing.fixtures import SERVICE_URLS, longest_delivery, make_settings
from outbox_kit.testing.harness import DELIVERIES, CounterChangedV1, install_kit, record_effect
from outbox_kit.transports.bus import Delivered
from outbox_kit.transports.envelope import (
    Envelope,
)

from {{ cookiecutter.package_name }}.container import Container, build_container


class RecordingDeliverer:
    """Records each delivery; can hang on its first row (to be killed) or fail poison rows."""

    def __init__(
        self, container: Container, name: str, *, hang_first: bool, takes_seconds: float = 0.0
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
            await session.exec(  # type: ignore[call-overload]
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


async def pending(container: Container) -> int:
    return (await container.admin().count_pending("outbox"))[0].pending


async def processor(args: argparse.Namespace) -> None:
    container = build_container(
        make_settings(
            args.db,
            application={"namespace": args.namespace, "instance_id": args.name},
            message_bus={"publish_timeout_seconds": min(10.0, longest_delivery(args.lease) / 2)},
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
    values = {**source_settings(container.settings()).__dict__}
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
    loop = Processor(source, wake=wake.subscribe(), interval_seconds=args.interval, clock=system_clock)
    tasks = [asyncio.create_task(loop.run())]
    if args.listen:
        listener = build_listener(container.settings(), wake)
        assert listener is not None
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


def barrier_handler(barrier: Path, name: str) -> Callable[[CounterChangedV1, SqlUnitOfWork], Awaitable[None]]:
    """A handler that waits until both racers are inside their handlers (both passed the inbox
    pre-check) before it writes: the loser must meet the inbox primary key at commit."""

    async def handler(event: CounterChangedV1, uow: SqlUnitOfWork) -> None:
        del event
        (barrier / name).touch()
        deadline = time.monotonic() + 30
        while len(list(barrier.iterdir())) < 2:  # noqa: ASYNC240 (two tiny files, polled)
            if time.monotonic() > deadline:
                msg = "the other consumer never entered its handler"
                raise RuntimeError(msg)
            await asyncio.sleep(0.02)
        print("entered", flush=True)
        await record_effect(uow, f"consumed-by-{name}")

    return handler


async def consumer(args: argparse.Namespace) -> None:
    """Consume one message (the same one in two processes) through the real pipeline."""
    container = build_container(make_settings(args.db, application={"namespace": args.namespace}))
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
    outcome = await container.pipeline().consume(racer, headers, body)
    print(outcome.value, flush=True)
    await container.database().dispose()


async def broker_racer(args: argparse.Namespace) -> None:
    """Consume ``kit.racer`` from a real RabbitMQ queue beside another process; report whether
    this process's copy was consumed or skipped as a duplicate, once it has handled one."""
    container = build_container(
        make_settings(
            args.db,
            application={"namespace": args.namespace},
            message_bus={"transport": "rabbitmq", "url": SERVICE_URLS["rabbitmq"]},
        )
    )
    await install_kit(container, create_tables=False)
    handler = barrier_handler(Path(args.barrier), args.name)
    container.handlers().consume("kit.racer", CounterChangedV1, handler)
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
    container = build_container(
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

    async def dies(event: CounterChangedV1, uow: SqlUnitOfWork) -> None:
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["processor", "consumer", "crasher", "broker-racer"])
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
    parser.add_argument("--message-id", default="")
    parser.add_argument("--start-at", default="0")
    parser.add_argument("--barrier", default=".")
    parser.add_argument("--transport", default="rabbitmq")
    parser.add_argument("--delivery-seconds", type=float, default=0.0)
    args = parser.parse_args(argv)
    roles = {"processor": processor, "consumer": consumer, "crasher": crasher, "broker-racer": broker_racer}
    asyncio.run(roles[args.role](args))


if __name__ == "__main__":
    main()
