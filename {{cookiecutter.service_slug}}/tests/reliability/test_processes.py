"""Concurrency claims proven with real processes against real PostgreSQL (slow tier)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from outbox_kit.application.context import capture_context
from outbox_kit.consume.subscribers import CRASH_GUARD_ERROR
from outbox_kit.persistence.tables import (
    OUTBOX_TABLE,
)
from outbox_kit.testing.fixtures import SERVICE_URLS, acting_as, fetch
from outbox_kit.testing.harness import DELIVERIES, EFFECTS, CounterChangedV1, install_kit
from outbox_kit.transports.envelope import (
    Envelope,
)

from {{ cookiecutter.package_name }}.container import (
    Container,
)

from .conformance import declared_topology

pytestmark = [pytest.mark.reliability, pytest.mark.slow, pytest.mark.postgres]
PROJECT = Path(__file__).resolve().parents[2]


@pytest.fixture
def database_url(postgres_url: str) -> str:
    return postgres_url


def start(role: str, url: str, *args: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if "__" not in k}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.reliability.actors", role, "--db", url, *args],
        cwd=PROJECT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_line(process: subprocess.Popen[str], wanted: str) -> None:
    """Read the actor's output until it prints ``wanted`` (FastStream logs on the same stream)."""
    assert process.stdout is not None
    for line in process.stdout:
        if line.strip() == wanted:
            return
    msg = f"the actor ended before it said {wanted!r}"
    raise AssertionError(msg)


def finish(process: subprocess.Popen[str], timeout: float = 180) -> str:
    stdout, stderr = process.communicate(timeout=timeout)
    assert process.returncode == 0, stderr[-4000:]
    return stdout


async def seed(container: Container, rows: list[dict[str, Any]]) -> None:
    now = datetime.now(UTC)
    values = [
        {
            "id": uuid.uuid4(),
            "event_name": "kit.counter-changed.v1",
            "kind": "integration",
            "payload": {},
            "occurred_on": now,
            "available_on": now,
            "retry_count": 0,
            "ordering_key": None,
            **row,
        }
        for row in rows
    ]
    async with container.database().session() as session:
        await session.exec(sa.insert(OUTBOX_TABLE), params=values)  # type: ignore[call-overload]
        await session.commit()
        await session.exec(sa.text("ANALYZE outbox_messages"))  # type: ignore[call-overload]


async def deliveries(container: Container) -> list[Any]:
    return await fetch(container, sa.select(DELIVERIES).order_by(DELIVERIES.c.id))


def assert_order_per_key(delivered: list[Any]) -> None:
    first_delivery: dict[str, list[tuple[float, int]]] = defaultdict(list)
    seen: set[str] = set()
    for d in delivered:
        if d.ordering_key is not None and d.row_id not in seen:
            seen.add(d.row_id)
            first_delivery[d.ordering_key].append((d.delivered_at, d.seq))
    for key, items in first_delivery.items():
        seqs = [seq for _, seq in sorted(items)]
        assert seqs == sorted(seqs), f"key {key} was delivered out of order"


def assert_each_key_waits_for_its_predecessors(delivered: list[Any], rows: list[Any]) -> None:
    """Stronger than sorted first deliveries: no delivery of a keyed row (retries included)
    starts before every earlier row of its key was finished (processed or dead-lettered), on
    either processor. Both clocks are this machine's."""
    by_key: dict[str, list[Any]] = defaultdict(list)
    for row in rows:
        if row.ordering_key is not None:
            by_key[row.ordering_key].append(row)
    for d in delivered:
        if d.ordering_key is None:
            continue
        for earlier in by_key[d.ordering_key]:
            if earlier.seq >= d.seq:
                continue
            finished = earlier.processed_on or earlier.dead_lettered_on
            assert finished is not None, f"row {earlier.id} of key {d.ordering_key} never finished"
            overlap = f"key {d.ordering_key}: seq {d.seq} ({d.processor}) began before {earlier.seq} ended"
            assert finished.timestamp() <= d.delivered_at, overlap


async def test_a_killed_processors_rows_are_delivered_after_its_lease(container: Container) -> None:
    await install_kit(container)
    await seed(container, [{} for _ in range(20)])
    url = container.settings().database.url
    doomed = start("processor", url, "--name", "doomed", "--hang-first", "--lease", "10", "--batch", "10")
    assert doomed.stdout is not None
    assert doomed.stdout.readline().strip() == "claimed"
    killed_at = time.time()
    doomed.send_signal(signal.SIGKILL)
    doomed.communicate(timeout=10)  # reaps it and closes its pipes
    leased = await fetch(container, sa.select(OUTBOX_TABLE).where(OUTBOX_TABLE.c.locked_by == "doomed"))
    assert len(leased) == 10
    lease_end = max(r.locked_until for r in leased).timestamp()
    finish(start("processor", url, "--name", "survivor", "--until-empty", "--lease", "10"))
    delivered = await deliveries(container)
    by_row = {d.row_id: d for d in delivered}
    assert len(by_row) == 20
    leased_ids = {str(r.id) for r in leased}
    for r in leased:
        assert by_row[str(r.id)].processor == "survivor"
        assert by_row[str(r.id)].delivered_at >= lease_end - 0.5  # not before the lease ran out
    free = [d for row_id, d in by_row.items() if row_id not in leased_ids]
    # The survivor was running while the lease held: it took the free rows at once and left
    # the leased ones alone until the lease ended (otherwise the check above proves nothing).
    assert all(d.processor == "survivor" and d.delivered_at < lease_end for d in free)
    assert lease_end > killed_at


async def test_order_per_key_holds_under_two_processors_with_a_poison_head(container: Container) -> None:
    """Sixteen keys (more than one batch of heads, so both processors find work), one of them
    behind a poison head, interleaved: order holds per key across both processes."""
    await install_kit(container)
    keys = [*(f"k{i:02}" for i in range(15)), "poisoned"]
    rows = []
    for index in range(6):
        for key in keys:
            poison = key == "poisoned" and index == 0
            rows.append({"ordering_key": key, "payload": {"poison": True} if poison else {}})
    await seed(container, rows)
    url = container.settings().database.url
    start_at = f"{time.time() + 6.0}"  # both poll from the same moment, whatever their start-up took
    processes = [
        start(
            "processor",
            url,
            *("--name", n, "--until-empty", "--max-retries", "3", "--batch", "5", "--start-at", start_at),
            *("--delivery-seconds", "0.05"),  # one process alone needs seconds: both take part
        )
        for n in ("p1", "p2")
    ]
    for process in processes:
        finish(process)
    delivered = await deliveries(container)
    assert_order_per_key(delivered)
    state = await fetch(container, sa.select(OUTBOX_TABLE).order_by(OUTBOX_TABLE.c.seq))
    assert_each_key_waits_for_its_predecessors(delivered, state)
    assert {d.processor for d in delivered} == {"p1", "p2"}  # both took part
    poison = [r for r in state if r.payload.get("poison")]
    assert [(r.retry_count, r.dead_letter_reason) for r in poison] == [(3, "retries_exhausted")]
    followers = [r for r in state if r.ordering_key == "poisoned" and not r.payload.get("poison")]
    assert all(r.processed_on is not None and r.processed_on >= poison[0].dead_lettered_on for r in followers)
    poison_deliveries = [d for d in delivered if d.row_id == str(poison[0].id)]
    assert len(poison_deliveries) == 3


async def test_notify_wakes_another_processs_processor(container: Container) -> None:
    await install_kit(container)
    url = container.settings().database.url
    namespace = container.settings().application.namespace
    sleeper = start(
        "processor",
        url,
        "--name",
        "listener",
        "--listen",
        "--interval",
        "60",
        "--seconds",
        "8",
        "--namespace",
        namespace,
    )
    assert sleeper.stdout is not None
    assert sleeper.stdout.readline().strip() == "listening"
    time.sleep(0.5)  # its first poll (on connect) has run; now it sleeps for 60 s
    with acting_as():
        async with container.units_of_work()() as uow:
            uow.enqueue(CounterChangedV1(counter_id="c", value=1))
            committed_at = time.time()
            await uow.commit()
    finish(sleeper)
    (delivery,) = await deliveries(container)
    assert delivery.processor == "listener"
    assert delivery.delivered_at - committed_at < 3.0, "the processor waited for its 60 s interval"


async def test_two_consumer_processes_racing_one_duplicate_give_one_effect(
    container: Container, tmp_path: Path
) -> None:
    """Both processes pass the inbox pre-check and are inside the handler at once (a file
    barrier proves it); the primary key at commit lets exactly one effect through."""
    await install_kit(container)
    url = container.settings().database.url
    message_id, start_at = str(uuid.uuid4()), f"{time.time() + 2.0}"
    racers = [
        start(
            "consumer",
            url,
            *("--name", name, "--message-id", message_id, "--start-at", start_at),
            *("--barrier", str(tmp_path)),
        )
        for name in ("c1", "c2")
    ]
    printed = sorted(finish(racer).split() for racer in racers)
    assert printed == [["entered", "consumed"], ["entered", "duplicate"]]  # the race, not the pre-check
    effects = await fetch(container, sa.select(EFFECTS.c.label))
    assert len(effects) == 1
    inbox = await fetch(container, sa.text("SELECT message_id FROM inbox_messages"))
    assert [r[0] for r in inbox] == [message_id]


def counter_message() -> Envelope:
    with acting_as():
        context = capture_context()
    body = json.dumps(CounterChangedV1(counter_id="c", value=1).model_dump(mode="json")).encode()
    return Envelope(str(uuid.uuid4()), CounterChangedV1.message_name, datetime.now(UTC), body, context)


@pytest.mark.rabbitmq
async def test_two_consumer_processes_on_one_queue_racing_a_duplicate_give_one_effect(
    container: Container, tmp_path: Path
) -> None:
    """The same message published twice to a real RabbitMQ queue read by two processes: each
    process takes one copy, both are inside the handler at once (the file barrier), and the
    broker wrapper acknowledges the loser as a duplicate: one effect, nothing redelivered."""
    await install_kit(container)
    url = container.settings().database.url
    namespace = f"race{uuid.uuid4().hex[:8]}"
    rabbitmq: dict[str, Any] = {"transport": "rabbitmq", "url": SERVICE_URLS["rabbitmq"]}
    async with declared_topology(url, namespace, "kit.racer", rabbitmq) as publisher:
        bus = publisher.bus()
        racers = [
            start(
                "broker-racer",
                url,
                *("--name", name, "--namespace", namespace, "--barrier", str(tmp_path), "--seconds", "60"),
            )
            for name in ("r1", "r2")
        ]
        try:
            for racer in racers:
                wait_for_line(racer, "ready")
            message = counter_message()
            await bus.publish(message)
            await bus.publish(message)  # the duplicate: a second publish of the same row
            ours = {"entered", "consumed", "duplicate"}  # what the actor prints (FastStream logs too)
            said = sorted(
                [line for line in finish(racer, timeout=90).splitlines() if line in ours] for racer in racers
            )
            assert said == [["entered", "consumed"], ["entered", "duplicate"]]  # the race, not the pre-check
            effects = await fetch(container, sa.select(EFFECTS.c.label))
            assert len(effects) == 1
            assert await bus.dead_letters("kit.racer") == []
        finally:
            for racer in racers:
                if racer.poll() is None:
                    racer.kill()


@pytest.mark.parametrize(
    "transport",
    [pytest.param("rabbitmq", marks=pytest.mark.rabbitmq), pytest.param("redis", marks=pytest.mark.redis)],
)
async def test_a_consumer_that_crashes_on_every_delivery_is_dead_lettered_by_the_guard(
    container: Container, transport: str
) -> None:
    """The handler kills its process every time (nothing is recorded, nothing acknowledged).
    With two attempts allowed, two processes die on the message; the third sees it a third time
    and the crash guard dead-letters it before any handler runs: no crash loop, no loss."""
    await install_kit(container)
    url = container.settings().database.url
    namespace = f"crash{uuid.uuid4().hex[:8]}"
    bus_settings: dict[str, Any] = {
        "transport": transport,
        "url": SERVICE_URLS[transport],
        "max_delivery_attempts": 2,
        "redelivery_delay_seconds": 0.3,  # as the crashers declare it
    }
    async with declared_topology(url, namespace, "kit.crasher", bus_settings) as publisher:
        bus = publisher.bus()
        await bus.publish(counter_message())
        runs: list[tuple[int, str]] = []
        for _ in range(4):
            options = ("--transport", transport, "--namespace", namespace, "--seconds", "30")
            crasher = start("crasher", url, *options)
            stdout, stderr = crasher.communicate(timeout=90)
            runs.append((crasher.returncode, stdout))
            if crasher.returncode != 3:
                assert crasher.returncode == 0, stderr[-4000:]
                break
        assert [code for code, _ in runs] == [3, 3, 0]
        assert all("handling" in out.splitlines() for _, out in runs[:2])  # died in the handler
        report = json.loads(next(line for line in runs[2][1].splitlines() if line.startswith("{")))
        assert report == {"error": CRASH_GUARD_ERROR, "attempts": "3"}
        assert await fetch(container, sa.select(EFFECTS.c.label)) == []
