"""The delivery guarantee under injected faults: real worker processes of this service, real
PostgreSQL, real brokers (``make test-reliability``).

Every scenario writes events through the real unit of work under many callers, lets worker
processes (``service_actor``: the service's own ``worker`` command) relay and consume them, injures
the processes or their lines, and then checks from the tables alone that nothing was lost, that
every effect happened exactly once (the inbox), under the caller the event was written by, and
that no outbox row is left pending. Each prints its figures into the run's summary table
(``reliability-report.md``): events, lost, duplicated effects, broker redeliveries (copies the
inbox recognised and skipped), time.

Isolation: the session's own PostgreSQL database (``conftest``) and a broker namespace per
scenario, deleted afterwards; every process started is killed at the end, also on failure.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import sqlalchemy as sa

from {{ cookiecutter.package_name }}.building_blocks.operations.tenant_scope import EVERY_TENANT
from {{ cookiecutter.package_name }}.building_blocks.persistence.tables import (
    OUTBOX_TABLE,
)
from {{ cookiecutter.package_name }}.building_blocks.unit_of_work.unit_of_work import (
    SqlUnitOfWork,
)
from {{ cookiecutter.package_name }}.container import Container, build_container

from ..conftest import SERVICE_URLS, fetch, make_settings
from ..kit import CounterChangedV1, install_kit
from ..tcp_proxy import TcpProxy, tcp_proxy
from .conformance import (
    Fleet,
    all_received,
    assert_keys_flowed_in_order,
    check_delivery,
    cycling,
    outbox_rows,
    received,
    wait_until,
    write_events,
)
from .service_actor import CRASHED_AFTER_PUBLISH, LEDGER, RELAY_POISON

pytestmark = [pytest.mark.reliability, pytest.mark.slow, pytest.mark.postgres]
ALL_BROKERS = [
    pytest.param("rabbitmq", marks=pytest.mark.rabbitmq),
    pytest.param("nats", marks=pytest.mark.nats),
    pytest.param("redis", marks=pytest.mark.redis),
]
RABBITMQ = [pytest.param("rabbitmq", marks=pytest.mark.rabbitmq)]
DRAIN_SECONDS = 240  # generous: a 2-core machine under CI load; a lost event still fails


@pytest.fixture
def database_url(postgres_url: str) -> str:
    return postgres_url


@dataclass
class Stage:
    """The test's side of a scenario (writes events, reads tables, owns the broker topology)
    and the worker processes that relay and consume."""

    container: Container
    fleet: Fleet
    began: float

    async def check(self, scenario: str, sent: list[Any], notes: str = "") -> None:
        await check_delivery(
            self.container, sent, self.fleet, scenario=scenario, began=self.began, notes=notes
        )


MakeStage = Callable[..., Awaitable[Stage]]


async def never_runs(event: CounterChangedV1, uow: SqlUnitOfWork) -> None:
    del event, uow  # the test process only declares the consumer's queue; workers consume


@pytest.fixture
async def stage(postgres_url: str, tmp_path: Path) -> AsyncIterator[MakeStage]:
    built: list[Stage] = []

    async def make(transport: str, *options: str, broker_url: str = "", database_url: str = "") -> Stage:
        namespace = f"rel{uuid.uuid4().hex[:8]}"
        bus = {
            "transport": transport,
            "url": SERVICE_URLS[transport],
            "max_delivery_attempts": 3,  # as the workers declare it
            "redelivery_delay_seconds": 0.2,
        }
        container = build_container(
            make_settings(postgres_url, application={"namespace": namespace}, message_bus=bus)
        )
        await install_kit(container)
        container.handlers().consume(LEDGER, CounterChangedV1, never_runs)
        await container.bus().start()  # the topology exists before any worker publishes
        fleet = Fleet(
            tmp_path,
            database_url or postgres_url,
            transport,
            broker_url or SERVICE_URLS[transport],
            namespace,
            options,
        )
        built.append(Stage(container, fleet, time.monotonic()))
        return built[-1]

    yield make
    for made in built:
        made.fleet.reap()
        await made.container.bus().stop()
        await made.container.bus().delete_topology()
        await made.container.database().dispose()


async def start_workers(fleet: Fleet, *names: str, options: tuple[str, ...] = ()) -> None:
    for name in names:
        fleet.start(name, *options)
    for name in names:
        await fleet.started(name)


# -- 1. workers killed at random -----------------------------------------------------------


@pytest.mark.parametrize("transport", ALL_BROKERS)
async def test_1_workers_killed_at_random_lose_nothing_and_duplicate_no_effect(
    stage: MakeStage, transport: str
) -> None:
    """5,000 events (half on 50 ordering keys) drained by two workers while one of them, chosen
    at random, is SIGKILLed at a random moment and restarted, four times."""
    scene = await stage(transport, "--lease", "3")
    sent = await write_events(scene.container, 2500, per_commit=25)
    sent += await write_events(scene.container, 2500, key_of=cycling(50), per_commit=25, first=2500)
    await start_workers(scene.fleet, "w1", "w2")
    chaos = random.Random()
    for _ in range(4):
        await asyncio.sleep(chaos.uniform(0.5, 2.5))
        victim = chaos.choice(sorted(scene.fleet.workers))
        scene.fleet.kill(victim)
        scene.fleet.start(victim)
    await all_received(scene.container, sent, DRAIN_SECONDS)
    await scene.fleet.stop_all()
    await scene.check("1 killed workers", sent, notes=f"{scene.fleet.kills} SIGKILLs")
    assert_keys_flowed_in_order(await outbox_rows(scene.container), await received(scene.container))


# -- 3. crash between publish and stamp ----------------------------------------------------


@pytest.mark.parametrize("transport", ALL_BROKERS)
async def test_3_a_crash_after_publish_before_the_stamp_is_deduplicated(
    stage: MakeStage, transport: str
) -> None:
    """The worker dies right after the broker confirmed a publish, before the processed stamp:
    the row is published again once its lease ends, and the copy has no second effect."""
    scene = await stage(transport, "--lease", "2")
    sent = await write_events(scene.container, 300, key_of=cycling(10))
    scene.fleet.start("doomed", "--crash-after-publish", "40")
    assert await scene.fleet.exited("doomed") == CRASHED_AFTER_PUBLISH
    unstamped = [
        r for r in await outbox_rows(scene.container) if r.locked_by == "doomed" and r.processed_on is None
    ]
    assert unstamped, "the crash left no leased row behind: the scenario proved nothing"
    await start_workers(scene.fleet, "survivor")
    await all_received(scene.container, sent, DRAIN_SECONDS)
    await scene.fleet.stop_all()
    await scene.check("3 crash after publish", sent, notes=f"{len(unstamped)} rows published, not stamped")
    if transport != "nats":  # JetStream drops a republish with the same Nats-Msg-Id itself
        assert scene.fleet.duplicates() >= 1, "no copy reached the inbox: the dedup was not exercised"


# -- 4. broker outage longer than the retry curve ------------------------------------------


def through(proxy: TcpProxy, url: str) -> str:
    parsed = urlparse(url)
    return parsed._replace(
        netloc=parsed.netloc.replace(f"{parsed.hostname}:{parsed.port}", f"127.0.0.1:{proxy.port}")
    ).geturl()


@pytest.mark.parametrize("transport", ALL_BROKERS)
async def test_4_a_broker_outage_longer_than_the_retry_curve_charges_nothing(
    stage: MakeStage, transport: str
) -> None:
    """The line to the broker is cut for 8 s, far beyond the relay's retry curve (3 retries,
    0.05 s base): nothing is dead-lettered or charged, the relay pauses instead of spinning (its
    claims are counted), and everything is delivered once the broker is back."""
    parsed = urlparse(SERVICE_URLS[transport])
    async with tcp_proxy(parsed.hostname or "127.0.0.1", parsed.port or 0) as proxy:
        scene = await stage(transport, broker_url=through(proxy, SERVICE_URLS[transport]))
        sent = await write_events(scene.container, 200)
        await start_workers(scene.fleet, "w1")
        await wait_until(lambda: _count_at_least(scene.container, 100), 60, "the first 100 delivered")
        await proxy.cut()
        sent += await write_events(scene.container, 300, first=200)
        claims_before = scene.fleet.status("w1").get("claims", 0)
        outage = 8.0
        await asyncio.sleep(outage)
        claims = scene.fleet.status("w1").get("claims", 0) - claims_before
        await proxy.start()
        await all_received(scene.container, sent, DRAIN_SECONDS)
        await scene.fleet.stop_all()
        rows = await outbox_rows(scene.container)
        await scene.check("4 broker outage", sent, notes=f"{claims:.0f} claims in {outage:.0f} s outage")
    assert [r for r in rows if r.dead_lettered_on is not None] == []
    assert max(r.retry_count for r in rows) == 0, "an outage was charged to the rows"
    assert claims <= outage / 0.2 + 5, f"{claims} claims in {outage} s: the relay spun"


async def _count_at_least(container: Container, wanted: int) -> bool:
    return len(await received(container)) >= wanted


# -- 6. SIGTERM mid-batch ------------------------------------------------------------------


@pytest.mark.parametrize("transport", RABBITMQ)
async def test_6_sigterm_mid_batch_charges_nothing_and_releases_what_it_did_not_reach(
    stage: MakeStage, transport: str
) -> None:
    """SIGTERM while a batch of 500 is in flight: a clean exit within the shutdown timeout,
    every published row stamped (no copy for the next worker to send again), the rows not
    reached released at once (no lease left to wait out), no retry charged."""
    scene = await stage(transport, "--batch", "500", "--lease", "60", "--shutdown-timeout", "5")
    sent = await write_events(scene.container, 2000, per_commit=50)
    await start_workers(scene.fleet, "w1")
    await wait_until(lambda: _count_at_least(scene.container, 100), 60, "the first 100 delivered")
    code, seconds = await scene.fleet.terminate("w1")
    assert code == 0, scene.fleet.tail(scene.fleet.retired[-1])
    assert seconds < 5 + 2, f"took {seconds:.1f} s to stop"
    rows = await outbox_rows(scene.container)
    stamped = {r.payload["counter_id"] for r in rows if r.processed_on is not None}
    consumed = {r.label for r in await received(scene.container)}
    assert consumed <= stamped, "a published row was left unstamped: it would be sent again"
    assert [r for r in rows if r.processed_on is None and r.locked_until is not None] == []
    assert max(r.retry_count for r in rows) == 0
    assert len(stamped) < len(sent), "the batch finished before the SIGTERM: nothing was interrupted"
    await start_workers(scene.fleet, "w2")
    await all_received(scene.container, sent, DRAIN_SECONDS)
    await scene.fleet.stop_all()
    await scene.check(
        "6 SIGTERM mid-batch", sent, notes=f"stopped in {seconds:.1f} s, {len(stamped)} stamped"
    )
    assert scene.fleet.duplicates() == 0


# -- 7. a poison event on an ordered key ----------------------------------------------------


@pytest.mark.parametrize("transport", RABBITMQ)
async def test_7_a_poison_event_dead_letters_and_releases_its_key_and_its_replay_keeps_order(
    stage: MakeStage, transport: str, tmp_path: Path
) -> None:
    """Ten keys of twenty events; key-3's first event cannot be published while a bug lasts.
    It is dead-lettered after its retries, its key's later events then flow in order, the other
    keys never waited for it; once fixed, its replay is delivered before any newer event of its
    key (one delivery per key at a time)."""
    poison_file = tmp_path / "the-bug"
    poison_file.touch()
    options = ("--max-retries", "3", "--backoff", "0.7", "--poison-file", str(poison_file))
    scene = await stage(transport, *options)
    sent = await write_events(
        scene.container, 200, key_of=cycling(10), values=lambda i: RELAY_POISON if i == 3 else i
    )
    legit = [s for s in sent if s.value != RELAY_POISON]
    await start_workers(scene.fleet, "w1", "w2")
    await all_received(scene.container, legit, DRAIN_SECONDS)
    rows = await outbox_rows(scene.container)
    (poison,) = [r for r in rows if r.payload["value"] == RELAY_POISON]
    await wait_until(lambda: _dead(scene.container, poison.id), 60, "the poison row dead-lettered")
    rows = await outbox_rows(scene.container)
    (poison,) = [r for r in rows if r.id == poison.id]
    assert (poison.retry_count, poison.dead_letter_reason) == (3, "retries_exhausted")
    effects = await received(scene.container)
    assert_keys_flowed_in_order(rows, effects)
    others = [r for r in rows if r.ordering_key != poison.ordering_key]
    assert max(r.processed_on for r in others) < poison.dead_lettered_on, "other keys waited"
    followers = [r for r in rows if r.ordering_key == poison.ordering_key and r.id != poison.id]
    assert min(r.processed_on for r in followers) >= poison.dead_lettered_on

    poison_file.unlink()  # the fix is deployed; the operator replays the dead letter
    await scene.container.admin().replay("outbox", [str(poison.id)], actor="operator", scope=EVERY_TENANT)
    key = poison.ordering_key
    newer = await write_events(scene.container, 20, key_of=lambda _: key, first=1000)
    await all_received(scene.container, [*sent, *newer], DRAIN_SECONDS)
    await scene.fleet.stop_all()
    rows = await outbox_rows(scene.container)
    (replayed,) = [r for r in rows if r.id == poison.id]
    arrivals = {e.label: e.received_at for e in await received(scene.container)}
    assert all(arrivals[s.label] >= replayed.processed_on.timestamp() for s in newer), "overtook the replay"
    await scene.check("7 poison on a key", [*sent, *newer], notes="dead-lettered, replayed")


async def _dead(container: Container, row_id: uuid.UUID) -> bool:
    (row,) = await fetch(
        container, sa.select(OUTBOX_TABLE.c.dead_lettered_on).where(OUTBOX_TABLE.c.id == row_id)
    )
    return row.dead_lettered_on is not None
