"""The reliability tier of a service (``make test-reliability``): the delivery guarantee under
injected faults, with real worker processes of the service, real PostgreSQL and real brokers;
and the mutation check (``make test-mutations``) that proves the scenarios catch the bugs they
exist for.

A service runs them by importing them into its ``tests/reliability/test_reliability.py``
(``from outbox_kit.testing.reliability import *``: the scenarios, their fixtures and marks), and
the summary hook into that folder's ``conftest.py``; every process builds the service's own
container (the suite's ``container_builder`` fixture, see ``outbox_kit.testing.processes``).

Conformance scenarios (``test_1`` .. ``test_10``) write events through the real unit of work under
many callers, let worker processes (the service's own ``worker`` command) relay and consume them,
injure the processes or their lines, and then check from the tables alone that nothing was lost,
that every effect happened exactly once (the inbox), under the caller the event was written by,
and that no outbox row is left pending. Each prints its figures into the run's summary table
(``reliability-report.md``): events, lost, duplicated effects, broker redeliveries (copies the
inbox recognised and skipped), time. Process scenarios prove the concurrency claims of single
parts (a killed processor's lease, order per key under two processors, a wake-up across
processes, consumers racing one duplicate, the crash guard).

Isolation: the session's own PostgreSQL database and a broker namespace per scenario, deleted
afterwards; every process started is killed at the end, also on failure.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

import outbox_kit
from outbox_kit.application.context import capture_context
from outbox_kit.consume.subscribers import CRASH_GUARD_ERROR
from outbox_kit.operations.rows import EVERY_TENANT
from outbox_kit.persistence.tables import (
    OUTBOX_TABLE,
)
from outbox_kit.runtime.container import OutboxContainer
from outbox_kit.testing.brokers import (
    LEFTOVERS,
    PUBLISH_RAW,
    HostileBatch,
    dead_letters_of,
    hostile_messages,
)
from outbox_kit.testing.fixtures import SERVICE_URLS, ContainerBuilder, acting_as, fetch
from outbox_kit.testing.harness import DELIVERIES, EFFECTS, CounterChangedV1, TcpProxy, install_kit, tcp_proxy
from outbox_kit.testing.processes import (
    CRASHED_AFTER_PUBLISH,
    HANDLER_POISON,
    LEDGER,
    READY_FOR_THE_CUE,
    RELAY_POISON,
    REPORT,
    Fleet,
    Sent,
    all_received,
    assert_keys_flowed_in_order,
    check_delivery,
    cycling,
    declared_topology,
    outbox_rows,
    process_environment,
    received,
    wait_until,
    write_events,
)
from outbox_kit.transports.envelope import (
    Envelope,
    Signer,
)

pytestmark = [pytest.mark.reliability, pytest.mark.slow, pytest.mark.postgres]
# What a service's test module imports (``from outbox_kit.testing.reliability import *``):
# the scenarios, their fixtures and their marks.
__all__ = [
    "database_url",
    "pytestmark",
    "stage",
    "start",
    "test_1_a_worker_frozen_past_its_lease_writes_no_outcome_when_it_resumes",
    "test_1_workers_killed_at_random_lose_nothing_and_duplicate_no_effect",
    "test_2_an_api_process_killed_after_its_commit_leaves_its_events_to_the_worker",
    "test_3_a_crash_after_publish_before_the_stamp_is_deduplicated",
    "test_4_a_broker_outage_longer_than_the_retry_curve_charges_nothing",
    "test_5_workers_recover_when_the_database_drops_every_connection",
    "test_5_workers_recover_when_the_database_restarts",
    "test_6_sigterm_mid_batch_charges_nothing_and_releases_what_it_did_not_reach",
    "test_7_a_poison_event_dead_letters_and_releases_its_key_and_its_replay_keeps_order",
    "test_8_rows_of_many_tenants_run_under_their_own_caller",
    "test_9_hostile_messages_in_a_normal_stream_are_dead_lettered_and_the_rest_flows",
    "test_10_sustained_load_drains_and_the_oldest_pending_age_stays_bounded",
    "test_a_consumer_that_crashes_on_every_delivery_is_dead_lettered_by_the_guard",
    "test_a_killed_processors_rows_are_delivered_after_its_lease",
    "test_notify_wakes_another_processs_processor",
    "test_order_per_key_holds_under_two_processors_with_a_poison_head",
    "test_two_consumer_processes_on_one_queue_racing_a_duplicate_give_one_effect",
    "test_two_consumer_processes_racing_one_duplicate_give_one_effect",
]
ALL_BROKERS = [
    pytest.param("rabbitmq", marks=pytest.mark.rabbitmq),
    pytest.param("nats", marks=pytest.mark.nats),
    pytest.param("redis", marks=pytest.mark.redis),
    pytest.param("kafka", marks=pytest.mark.kafka),
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

    container: OutboxContainer
    fleet: Fleet
    began: float

    async def check(self, scenario: str, sent: list[Any], notes: str = "") -> None:
        await check_delivery(
            self.container, sent, self.fleet, scenario=scenario, began=self.began, notes=notes
        )


MakeStage = Callable[..., Awaitable[Stage]]


@pytest.fixture
async def stage(
    postgres_url: str, tmp_path: Path, container_builder: ContainerBuilder
) -> AsyncIterator[MakeStage]:
    async with AsyncExitStack() as stack:

        async def make(transport: str, *options: str, broker_url: str = "", database_url: str = "") -> Stage:
            namespace = f"rel{uuid.uuid4().hex[:8]}"
            bus = {
                "transport": transport,
                "url": SERVICE_URLS[transport],
                "max_delivery_attempts": 3,  # as the workers declare it
                "redelivery_delay_seconds": 1.0,
            }
            container = await stack.enter_async_context(
                declared_topology(container_builder, postgres_url, namespace, LEDGER, bus, fresh_tables=True)
            )
            fleet = Fleet(
                tmp_path,
                container_builder,
                database_url or postgres_url,
                transport,
                broker_url or SERVICE_URLS[transport],
                namespace,
                options,
            )
            stack.callback(fleet.reap)  # first out: the workers go before their topology
            return Stage(container, fleet, time.monotonic())

        yield make


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
    """3,000 events (half on 50 ordering keys) drained by two workers while one of them, chosen
    at random, is SIGKILLed at a random moment and restarted, four times (the kills fall within
    the first ten seconds, while the drain is running)."""
    scene = await stage(transport, "--lease", "3")
    sent = await write_events(scene.container, 1500, per_commit=25)
    sent += await write_events(scene.container, 1500, key_of=cycling(50), per_commit=25, first=1500)
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


@pytest.mark.parametrize("transport", RABBITMQ)
async def test_1_a_worker_frozen_past_its_lease_writes_no_outcome_when_it_resumes(
    stage: MakeStage, transport: str
) -> None:
    """A worker is frozen (SIGSTOP) in the middle of its deliveries for longer than its lease;
    the other worker takes the rows over and finishes everything; then the frozen one resumes
    and ends its deliveries (a publish finishing, or its time limit, which ran out while it was
    frozen): none of its outcomes may land (each row's lock token changed), so no row's outcome
    (stamp, failure record, lease) changes after the resume, and its copies have no effect."""
    scene = await stage(transport, "--lease", "2")
    sent = await write_events(scene.container, 1500, key_of=cycling(40), per_commit=50)
    # Only its relay is frozen: a frozen consumer would hold its prefetched messages as well. It
    # starts first: a relay publishing its batches whole drains the 40 keys' heads as soon as
    # they are free, so a relay that starts second can find none until the backlog is gone. The
    # other is started ahead and waits for its cue: on a loaded machine its start-up took longer
    # than the frozen relay needed to publish the whole backlog alone, and nothing was left in
    # flight to freeze.
    scene.fleet.start("other", "--wait-for-cue")
    await scene.fleet.said("other", READY_FOR_THE_CUE)
    await start_workers(scene.fleet, "frozen", options=("--relay-only", "--after-publish-seconds", "0.2"))
    await scene.fleet.said("frozen", "not stamped yet")
    scene.fleet.cue("other")
    await scene.fleet.started("other")
    await wait_until(lambda: _count_at_least(scene.container, 200), 60, "the first 200 delivered")
    await scene.fleet.said("frozen", "not stamped yet", anew=True)  # publishes in flight now:
    scene.fleet.freeze("frozen")
    frozen_at = time.time()
    await all_received(scene.container, sent, DRAIN_SECONDS)
    await wait_until(lambda: _nothing_pending(scene.container), 60, "every row finished")
    before = {row.id: _outcome(row) for row in await outbox_rows(scene.container)}
    resumed_at = time.time()
    scene.fleet.thaw("frozen")
    await asyncio.sleep(3.0)  # its publishes, and its stamp or failure writes, run now
    await scene.fleet.stop_all()
    late = [row.id for row in await outbox_rows(scene.container) if _outcome(row) != before[row.id]]
    await scene.check("1 frozen past its lease", sent, notes=f"frozen {resumed_at - frozen_at:.1f} s")
    assert late == [], f"{len(late)} stale outcomes landed after the resume"
    lost = scene.fleet.status("frozen").get("outbox_lost_leases_total", 0)
    assert lost >= 1, "the frozen worker had nothing in flight: the scenario proved nothing"


def _outcome(row: Any) -> tuple[Any, ...]:
    """What an outcome write changes on a row: stamp, failure record, dead letter, lease."""
    return (
        row.processed_on,
        row.dead_lettered_on,
        row.retry_count,
        row.last_error,
        row.lock_token,
        row.locked_until,
    )


async def _nothing_pending(container: OutboxContainer) -> bool:
    return all(
        r.processed_on is not None or r.dead_lettered_on is not None for r in await outbox_rows(container)
    )


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
    charged = {r.last_error for r in rows if r.retry_count}
    assert not charged, f"an outage was charged to the rows: {sorted(charged)[:3]}"
    # Paused, it claims at most about once per polling interval (0.2 s); a spinning relay
    # claims hundreds of times a second.
    assert claims <= 2 * outage / 0.2, f"{claims} claims in {outage} s: the relay spun"


async def _count_at_least(container: OutboxContainer, wanted: int) -> bool:
    return len(await received(container)) >= wanted


# -- 6. SIGTERM mid-batch ------------------------------------------------------------------


@pytest.mark.parametrize("transport", RABBITMQ)
async def test_6_sigterm_mid_batch_charges_nothing_and_releases_what_it_did_not_reach(
    stage: MakeStage, transport: str
) -> None:
    """SIGTERM while a batch of 500 is in flight: a clean exit within the shutdown timeout,
    every published row stamped (no copy for the next worker to send again), the rows not
    reached released at once (no lease left to wait out), no retry charged.

    The batch's publishes get half the shutdown timeout to end (``processor.cycle``): 20 s, not
    the default 5, because 500 persistent confirms (each an fsync of the broker's) took longer
    than 2.5 s on a loaded CI machine. A stop still takes only as long as the batch needs."""
    timeout = 20
    scene = await stage(transport, "--batch", "500", "--lease", "60", "--shutdown-timeout", str(timeout))
    sent = await write_events(scene.container, 1000, per_commit=50)
    await start_workers(scene.fleet, "w1")
    await wait_until(lambda: _count_at_least(scene.container, 100), 60, "the first 100 delivered")
    code, seconds = await scene.fleet.terminate("w1")
    assert code == 0, scene.fleet.tail(scene.fleet.retired[-1])
    assert seconds < timeout + 2, f"took {seconds:.1f} s to stop"
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
    options = ("--max-retries", "3", "--backoff", "1.5", "--poison-file", str(poison_file))
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


async def _dead(container: OutboxContainer, row_id: uuid.UUID) -> bool:
    (row,) = await fetch(
        container, sa.select(OUTBOX_TABLE.c.dead_lettered_on).where(OUTBOX_TABLE.c.id == row_id)
    )
    return row.dead_lettered_on is not None


# -- 8. many tenants interleaved -----------------------------------------------------------


@pytest.mark.parametrize("transport", RABBITMQ)
async def test_8_rows_of_many_tenants_run_under_their_own_caller(stage: MakeStage, transport: str) -> None:
    """1,000 events, one commit each, cycling through 50 tenants, 5 users, two role sets and a
    correlation per commit, relayed by two workers: every handler ran under its own row's caller
    (``check_delivery`` compares tenant, user, roles and correlation per effect)."""
    scene = await stage(transport)
    sent = await write_events(scene.container, 1000, tenants=50, per_commit=1)
    assert len({s.tenant for s in sent}) == 50
    await start_workers(scene.fleet, "w1", "w2")
    await all_received(scene.container, sent, DRAIN_SECONDS)
    await scene.fleet.stop_all()
    workers = {e.worker for e in await received(scene.container)}
    await scene.check("8 many tenants", sent, notes=f"50 tenants, consumed by {len(workers)} workers")
    assert workers == {"w1", "w2"}, "one worker did all the work: the interleaving proved less"


# -- 9. hostile traffic in a normal stream -------------------------------------------------


def hostile_extras(container: OutboxContainer, batch: HostileBatch) -> None:
    """Beyond the broker tests' set: a forged signature, a tampered body, and a stale message, an
    oversized header and an unknown event name that are each correctly signed."""
    body = json.dumps({"counter_id": "hostile", "value": 1}).encode()
    signer = container.signer()
    forger = Signer({"test": "not-the-real-secret"}, "test", allow_unsigned=False)
    stale = (datetime.now(UTC) - timedelta(days=15)).isoformat()
    cases: list[tuple[str, str, Signer, dict[str, Any]]] = [
        ("forged", "bad_signature", forger, {}),
        ("stale", "stale", signer, {"x-occurred-on": stale}),
        ("oversized", "oversized_header", signer, {"x-user-roles": ",".join(f"r{i}" for i in range(3000))}),
        ("unknown-event", "unknown_event", signer, {"x-event-name": "kit.never-heard-of.v1"}),
        ("tampered", "bad_signature", signer, {}),
    ]
    for label, reason, signed_by, extra in cases:
        batch.add(label, body, reason, signed=False, extra=extra)
        message = batch.messages[-1]
        headers = signed_by.sign(message.headers, body)
        sent_body = body.replace(b"1}", b"2}") if label == "tampered" else body  # changed after signing
        batch.messages[-1] = dataclasses.replace(message, headers=headers, body=sent_body)


@pytest.mark.parametrize("transport", ALL_BROKERS)
async def test_9_hostile_messages_in_a_normal_stream_are_dead_lettered_and_the_rest_flows(
    stage: MakeStage, transport: str
) -> None:
    """Hostile messages published raw into the consumer's stream while two workers relay 500
    legitimate events and one whose handler always fails: each hostile one and the poison are
    dead-lettered with their reason, every legitimate one is handled once, nothing is left on
    the main queue or stream."""
    scene = await stage(transport)
    sent = await write_events(scene.container, 500, key_of=cycling(20))
    await write_events(scene.container, 1, first=9000, values=lambda _: HANDLER_POISON)  # via the outbox
    await start_workers(scene.fleet, "w1", "w2")
    batch = hostile_messages(scene.container, transport)
    hostile_extras(scene.container, batch)
    await PUBLISH_RAW[transport](scene.container, batch.messages)
    await all_received(scene.container, sent, DRAIN_SECONDS)
    expected = len(batch.messages) + 1  # and the handler's poison
    letters = await dead_letters_of(scene.container, batch.messages, within=60, expected=expected)
    await scene.fleet.stop_all()
    reasons = {key: letter.error for key, letter in letters.items()}
    for message in batch.messages:
        assert reasons[message.message_id].startswith(f"rejected: {message.reason}:"), message.label
    handler_failures = [e for e in reasons.values() if "a handler that fails on this message" in e]
    assert len(handler_failures) == 1, reasons
    assert set((await LEFTOVERS[transport](scene.container)).values()) == {0}
    assert {e.label for e in await received(scene.container)} == {s.label for s in sent}
    await scene.check("9 hostile traffic", sent, notes=f"{expected} dead-lettered with their reason")


# -- 10. sustained load ----------------------------------------------------------------------


SUSTAINED_SECONDS = 40


@pytest.mark.parametrize("transport", RABBITMQ)
async def test_10_sustained_load_drains_and_the_oldest_pending_age_stays_bounded(
    stage: MakeStage, transport: str
) -> None:
    """60 events per second for 40 s, two workers: sampled every second, the age of the
    oldest pending row stays bounded and does not grow (a relay slower than the writers would
    show a backlog aging second by second), and the backlog drains once the writers stop."""
    scene = await stage(transport)
    await start_workers(scene.fleet, "w1", "w2")
    sent: list[Any] = []
    ages: list[float] = []
    began = time.monotonic()
    for second in range(SUSTAINED_SECONDS):
        sent += await write_events(scene.container, 60, per_commit=10, first=second * 60)
        ages.append(await oldest_pending_age(scene.container))
        await asyncio.sleep(max(0.0, began + second + 1 - time.monotonic()))
    rate = len(sent) / (time.monotonic() - began)
    await all_received(scene.container, sent, DRAIN_SECONDS)
    drained = time.monotonic() - began - SUSTAINED_SECONDS
    await scene.fleet.stop_all()
    window = SUSTAINED_SECONDS // 3
    early, late = statistics.median(ages[:window]), statistics.median(ages[-window:])
    notes = (
        f"{rate:.0f}/s written; oldest pending: max {max(ages):.1f} s, median {early:.1f} s then {late:.1f} s"
    )
    await scene.check("10 sustained load", sent, notes=f"{notes}; drained {drained:.1f} s after")
    assert max(ages) < 15, f"the backlog aged to {max(ages):.1f} s"
    assert late <= 2 * early + 2, f"the backlog kept aging: median {early:.1f} s, then {late:.1f} s"


async def oldest_pending_age(container: OutboxContainer) -> float:
    c = OUTBOX_TABLE.c
    query = sa.select(sa.func.min(c.occurred_on)).where(
        c.processed_on.is_(None), c.dead_lettered_on.is_(None)
    )
    (row,) = await fetch(container, query)
    return 0.0 if row[0] is None else (datetime.now(UTC) - row[0]).total_seconds()


# -- 5. the database drops every connection, or restarts -------------------------------------


async def terminate_backends(container: OutboxContainer) -> int:
    """``pg_terminate_backend`` on every other connection to the test database."""
    async with container.database().session() as session:
        result = await session.exec(  # type: ignore[call-overload]
            sa.text(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        )
        return int(result.scalar_one())


@pytest.mark.parametrize("transport", RABBITMQ)
async def test_5_workers_recover_when_the_database_drops_every_connection(
    stage: MakeStage, transport: str
) -> None:
    """Every connection of the workers is terminated (``pg_terminate_backend``) in the middle of
    a drain, twice: processors, consumers and the LISTEN connection reconnect on their own (the
    last batch is written after the polling fallback was set to 30 s, so only a re-established
    LISTEN delivers it in time), and nothing is charged or dead-lettered."""
    scene = await stage(transport, "--interval", "30")
    sent = await write_events(scene.container, 1000)
    await start_workers(scene.fleet, "w1", "w2")
    await wait_until(lambda: _count_at_least(scene.container, 200), 60, "the first 200 delivered")
    terminated = await terminate_backends(scene.container)
    await asyncio.sleep(1.0)
    terminated += await terminate_backends(scene.container)
    await all_received(scene.container, sent, DRAIN_SECONDS)
    await asyncio.sleep(2.0)  # the LISTEN connection's reconnect
    late = await write_events(scene.container, 50, first=5000)
    written_at = time.monotonic()
    await all_received(scene.container, late, 20)  # within the 30 s fallback: woken by NOTIFY
    woken_in = time.monotonic() - written_at
    await scene.fleet.stop_all()
    rows = await outbox_rows(scene.container)
    await scene.check("5 connections terminated", [*sent, *late], notes=f"{terminated} backends killed")
    assert terminated >= 4, "the workers held no connections: nothing was injured"
    assert [r for r in rows if r.dead_lettered_on is not None] == []
    assert max(r.retry_count for r in rows) == 0, "a database outage was charged to the rows"
    assert woken_in < 20


@pytest.mark.parametrize("transport", RABBITMQ)
async def test_5_workers_recover_when_the_database_restarts(
    stage: MakeStage, transport: str, postgres_url: str
) -> None:
    """The database goes away for 5 s (connections dropped, new ones refused), then returns, as
    a restart looks from the workers (the machine's shared server is not restarted: other test
    runs use it; the line through a proxy is). Nothing is lost, charged or dead-lettered."""
    url = make_url(postgres_url)
    async with tcp_proxy(url.host or "127.0.0.1", url.port or 5432) as proxy:
        through_proxy = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
        scene = await stage(transport, database_url=through_proxy)
        sent = await write_events(scene.container, 1000)
        await start_workers(scene.fleet, "w1", "w2")
        await wait_until(lambda: _count_at_least(scene.container, 200), 60, "the first 200 delivered")
        await proxy.cut()
        await asyncio.sleep(5.0)
        await proxy.start()
        await all_received(scene.container, sent, DRAIN_SECONDS)
        await scene.fleet.stop_all()
    rows = await outbox_rows(scene.container)
    await scene.check("5 database restart", sent, notes="5 s without the database")
    assert [r for r in rows if r.dead_lettered_on is not None] == []
    assert max(r.retry_count for r in rows) == 0, "a database outage was charged to the rows"


# -- 2. an API process killed right after its commit ---------------------------------------


@pytest.mark.parametrize("transport", RABBITMQ)
async def test_2_an_api_process_killed_after_its_commit_leaves_its_events_to_the_worker(
    stage: MakeStage, transport: str
) -> None:
    """Two API processes commit counters with three notes each; the notes are local domain
    events each process runs in-process right after its commit, every handler taking 0.6 s
    against a 1 s lease (so a row's lease must be renewed just before its handler). One API
    process is SIGKILLed as the handlers of a commit begin: the worker delivers what it left
    once the lease ends, every note takes effect once, under its writer's context, and no
    note's handler ever runs in two processes at once (runs recorded as they start)."""
    handler_seconds = 0.6
    options = ("--lease", "1", "--processing-delay", "0.5", "--handler-seconds", f"{handler_seconds}")
    scene = await stage(transport, *options)
    await start_workers(scene.fleet, "worker")
    for name in ("api1", "api2"):
        scene.fleet.start(name, "--commits", "6")
    await scene.fleet.said("api1", "handling api1-2-0")
    scene.fleet.kill("api1")
    assert await scene.fleet.exited("api2", timeout=120) == 0
    noted = [r for r in await outbox_rows(scene.container) if r.event_name == "kit.noted.v1"]
    sent = [
        Sent(r.payload["text"], None, 0, r.tenant_id, r.user_id, r.user_roles, r.correlation_id)
        for r in noted
    ]
    await all_received(scene.container, sent, DRAIN_SECONDS)
    await scene.fleet.stop_all()
    runs = await fetch(scene.container, sa.select(DELIVERIES).order_by(DELIVERIES.c.delivered_at))
    starts: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for run in runs:
        starts[run.row_id].append((run.delivered_at, run.processor))
    for text, began in starts.items():
        for (first, by), (second, then) in itertools.pairwise(began):
            assert second - first >= handler_seconds - 0.05, f"{text} ran in {by} and {then} at once"
    by_worker = {e.label for e in await received(scene.container) if e.worker == "worker"}
    await scene.check(
        "2 API killed after commit", sent, notes=f"{len(by_worker)} notes finished by the worker"
    )
    assert any(label.startswith("api1-2-") for label in by_worker), (
        "the killed commit's notes were not taken over"
    )


# -- concurrency claims of single parts, each in processes of its own -----------------------


StartPart = Callable[..., subprocess.Popen[str]]


@pytest.fixture
def start(container_builder: ContainerBuilder) -> StartPart:
    """Start one part of the pipeline as a process of its own (``processes``: ``processor``,
    ``consumer``, ``crasher``, ``broker-racer``) on this suite's container."""

    def part(role: str, url: str, *args: str) -> subprocess.Popen[str]:
        return start_part(container_builder, role, url, *args)

    return part


def start_part(build: ContainerBuilder, role: str, url: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "outbox_kit.testing.processes", role, "--db", url, *args],
        env=process_environment(build),
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


async def seed(container: OutboxContainer, rows: list[dict[str, Any]]) -> None:
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
        await session.exec(sa.insert(OUTBOX_TABLE), params=values)
        await session.commit()
        await session.exec(sa.text("ANALYZE outbox_messages"))  # type: ignore[call-overload]


async def deliveries(container: OutboxContainer) -> list[Any]:
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


async def test_a_killed_processors_rows_are_delivered_after_its_lease(
    start: StartPart, container: OutboxContainer
) -> None:
    await install_kit(container)
    await seed(container, [{} for _ in range(20)])
    url = container.settings().database.url
    # The survivor starts first and waits, ready, for its cue: a slow start-up on a busy machine
    # must not eat the lease it has to be seen leaving alone.
    survivor = start(
        "processor", url, "--name", "survivor", "--until-empty", "--lease", "10", "--wait-for-cue"
    )
    wait_for_line(survivor, "ready")
    doomed = start("processor", url, "--name", "doomed", "--hang-first", "--lease", "10", "--batch", "10")
    assert doomed.stdout is not None
    assert doomed.stdout.readline().strip() == "claimed"
    killed_at = time.time()
    doomed.send_signal(signal.SIGKILL)
    doomed.communicate(timeout=10)  # reaps it and closes its pipes
    leased = await fetch(container, sa.select(OUTBOX_TABLE).where(OUTBOX_TABLE.c.locked_by == "doomed"))
    assert len(leased) == 10
    lease_end = max(r.locked_until for r in leased).timestamp()
    survivor.send_signal(signal.SIGUSR1)
    finish(survivor)
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


async def test_order_per_key_holds_under_two_processors_with_a_poison_head(
    start: StartPart, container: OutboxContainer
) -> None:
    """Sixteen keys (more than one batch of heads, so both processors find work), one of them
    behind a poison head, interleaved: order holds per key across both processes."""
    await install_kit(container)
    keys = [*(f"k{i:02}" for i in range(15)), "poisoned"]
    rows = []
    for index in range(6):
        for key in keys:
            is_poison = key == "poisoned" and index == 0
            rows.append({"ordering_key": key, "payload": {"poison": True} if is_poison else {}})
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


async def test_notify_wakes_another_processs_processor(start: StartPart, container: OutboxContainer) -> None:
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
    start: StartPart, container: OutboxContainer, tmp_path: Path
) -> None:
    """Both processes consume the same message at once: the first runs its handler while the
    second's copy has arrived (a file barrier proves it) and waits at its inbox insert on the row's
    key; when the first commits, the second finds the row and skips: one effect, one handler run."""
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
    assert printed == [["duplicate"], ["entered", "consumed"]]  # the race: both had arrived
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
    start: StartPart, container_builder: ContainerBuilder, container: OutboxContainer, tmp_path: Path
) -> None:
    """The same message published twice to a real RabbitMQ queue read by two processes: each
    process takes one copy, both copies are in the consume pipeline at once (the file barrier),
    the loser waits at its inbox insert and the broker wrapper acknowledges it as a duplicate: one
    effect, one handler run, nothing redelivered."""
    await install_kit(container)
    url = container.settings().database.url
    namespace = f"race{uuid.uuid4().hex[:8]}"
    rabbitmq: dict[str, Any] = {"transport": "rabbitmq", "url": SERVICE_URLS["rabbitmq"]}
    async with declared_topology(container_builder, url, namespace, "kit.racer", rabbitmq) as publisher:
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
            assert said == [["duplicate"], ["entered", "consumed"]]  # the race: both had arrived
            effects = await fetch(container, sa.select(EFFECTS.c.label))
            assert len(effects) == 1
            assert await bus.dead_letters("kit.racer") == []  # type: ignore[attr-defined]
        finally:
            for racer in racers:
                if racer.poll() is None:
                    racer.kill()


@pytest.mark.parametrize(
    "transport",
    [pytest.param("rabbitmq", marks=pytest.mark.rabbitmq), pytest.param("redis", marks=pytest.mark.redis)],
)
async def test_a_consumer_that_crashes_on_every_delivery_is_dead_lettered_by_the_guard(
    start: StartPart, container_builder: ContainerBuilder, container: OutboxContainer, transport: str
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
    async with declared_topology(container_builder, url, namespace, "kit.crasher", bus_settings) as publisher:
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


# -- the summary -------------------------------------------------------------------------------------
# The reliability tier's summary: one table of every conformance scenario that ran, printed at
# the end of the run and written to ``reliability-report.md`` (or ``RELIABILITY_REPORT``).


COLUMNS = (
    ("scenario", "scenario"),
    ("transport", "transport"),
    ("events", "events"),
    ("lost", "lost"),
    ("duplicated_effects", "duplicated effects"),
    ("wrong_context", "wrong context"),
    ("broker_redeliveries", "broker redeliveries"),
    ("seconds", "time (s)"),
    ("notes", "notes"),
)


def summary_table() -> str:
    lines = [
        "| " + " | ".join(title for _, title in COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    lines += ["| " + " | ".join(str(row[key]) for key, _ in COLUMNS) + " |" for row in REPORT]
    return "\n".join(lines)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not REPORT:
        return
    table = summary_table()
    heading = (
        f"Reliability scenarios, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, "
        f"{platform.node() or 'this machine'} ({os.cpu_count()} CPUs), Python {platform.python_version()}"
    )
    path = Path(os.environ.get("RELIABILITY_REPORT", "reliability-report.md"))
    path.write_text(f"{heading}\n\n{table}\n", encoding="utf-8")
    terminalreporter.write_sep("=", "reliability summary")
    terminalreporter.write_line(table)
    terminalreporter.write_line(f"(written to {path})")


# -- the mutation check -----------------------------------------------------------------------------
# The mutation check of the reliability tier: do the scenarios catch the bugs they exist for?
#
# ``python -m outbox_kit.testing.reliability [--only NAME] [--report PATH] [--skip-baseline]
# [--keep] [--jobs N]`` (``make test-mutations``), run from the service root with the service's
# virtual environment and the services up.
#
# Each mutation below is a known bug, written as exact text replacements in named files. For each
# one, the service (everything but its virtual environment, caches and local databases) is copied
# into a fresh temporary directory, the mutation is applied there, and pytest runs the mutation's
# selected tests in the copy with ``PYTHONPATH=<copy>/src:<copy>/kit/src:<copy>``, so the copy's
# code and kit are imported instead of the editable installs (checked before every run: a check
# that imports the unmutated code would pass without testing anything). The mutation is *caught*
# when a test fails; a run that cannot even collect or set up its tests is *broken* (a mutation
# that breaks the import is not a caught bug), and a run that passes means the bug *survived*.
# Each original snippet must occur exactly once in its file: a refactor that moves it fails this
# check loudly ("no longer applies") instead of silently mutating nothing.
#
# Before the mutations, the union of the selected tests runs on an unmutated copy and must pass
# (a selection that fails anyway proves nothing). The table (mutation, what it breaks, the test
# that caught it, result, seconds) is printed and written to ``--report``
# (``reliability-mutations.md`` in the service root by default). The exit status is 1 when a
# mutation survived, broke or no longer applies, or when the baseline failed.


ROOT = Path.cwd()  # the service's root: ``make test-mutations`` runs there
PACKAGE = "src/{package}"  # the package folder, found at run time in the copy's src/
KIT = "kit/src/outbox_kit"  # the kit, vendored beside the service
DEFAULT_REPORT = "reliability-mutations.md"
RUN_TIMEOUT_SECONDS = 1200


@dataclass(frozen=True)
class Edit:
    """Replace ``original`` (which must occur exactly once) in ``path`` (relative to the service
    root; ``{package}`` is the package's name) with ``replacement``."""

    path: str
    original: str
    replacement: str


@dataclass(frozen=True)
class Mutation:
    name: str
    breaks: str
    edits: tuple[Edit, ...]
    selection: tuple[str, ...]  # pytest arguments: node ids, or "-k", EXPR / "-m", EXPR


# The service's test module that imports this module's scenarios.
SCENARIOS = "tests/reliability/test_reliability.py"
PROCESSES = CONFORMANCE = SCENARIOS
CRASH_GUARD = "test_a_consumer_that_crashes_on_every_delivery_is_dead_lettered_by_the_guard"

MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        name="outcome-without-token-guard",
        breaks="outcome writes (stamp, release, failure record) match the row id only, not the lock token",
        edits=(
            Edit(
                f"{KIT}/persistence/tables.py",
                "return sa.and_(self._c.id.in_(list(ids)), self._c.lock_token == token)",
                "return self._c.id.in_(list(ids))",
            ),
            Edit(
                f"{KIT}/persistence/tables.py",
                ".where(self._c.id == row_id, self._c.lock_token == token)\n            .values(**values)",
                ".where(self._c.id == row_id)\n            .values(**values)",
            ),
            Edit(  # the stamp of a published batch, built once
                f"{KIT}/persistence/tables.py",
                'guard = self._c.lock_token == sa.bindparam("token", type_=sa.Uuid())',
                'guard = sa.bindparam("token", type_=sa.Uuid()).is_not(None)',
            ),
        ),
        # A worker frozen past its lease resumes and stamps rows another worker finished.
        selection=(
            f"{CONFORMANCE}::test_1_a_worker_frozen_past_its_lease_writes_no_outcome_when_it_resumes",
        ),
    ),
    Mutation(
        name="ack-before-inbox-commit",
        breaks="the broker message is acknowledged before the handler's transaction (inbox row) commits",
        edits=(
            Edit(
                f"{KIT}/consume/subscribers.py",
                "        try:\n            async with keep_alive(delivery):\n",
                "        await delivery.ack()\n        try:\n            async with keep_alive(delivery):\n",
            ),
            Edit(
                f"{KIT}/consume/subscribers.py",
                "reason=HANDLER_FAILED)\n            return False\n        await delivery.ack()\n",
                "reason=HANDLER_FAILED)\n            return False\n",
            ),
        ),
        # The handler kills its process: acknowledged early, the message is gone for good and
        # the next process never sees it (the crash guard never gets its third delivery).
        selection=(f"{PROCESSES}::{CRASH_GUARD}[rabbitmq]",),
    ),
    Mutation(
        name="claim-without-ordering-guard",
        breaks="the claim takes any free keyed row, not only the head of its key",
        edits=(
            Edit(
                f"{KIT}/processor/claim.py",
                "        .where(no_earlier)\n",
                "        .where(sa.true())\n",
            ),
        ),
        # A backing-off head has no lock token, so only this guard holds its followers back;
        # and only a window that yields a whole batch uses it (a smaller backlog goes through
        # the key scan, which finds heads anyway): hence a poison head and a 96-row backlog.
        selection=(f"{PROCESSES}::test_order_per_key_holds_under_two_processors_with_a_poison_head",),
    ),
    Mutation(
        name="inbox-without-unique-key",
        breaks="inbox_messages is created without its (message_id, consumer) primary key",
        edits=(
            Edit(
                "migrations/versions/0001_outbox_core.py",
                '        sa.PrimaryKeyConstraint("message_id", "consumer"),\n',
                "",
            ),
        ),
        # Both copies are in the pipeline at once (a file barrier): only the key stops the second.
        selection=(f"{PROCESSES}::test_two_consumer_processes_racing_one_duplicate_give_one_effect",),
    ),
    Mutation(
        name="in-process-without-lease-renewal",
        breaks="in-process dispatch runs a row's handlers without renewing its lease first",
        edits=(
            Edit(
                f"{KIT}/processor/in_process.py",
                "            await self._leases.renew(row)\n",
                "",
            ),
        ),
        # API processes dispatch notes whose handlers outlast the lease beside a worker: without
        # the renewal, the worker claims a later note of a commit while the API runs it too.
        selection=(
            f"{CONFORMANCE}::test_2_an_api_process_killed_after_its_commit_leaves_its_events_to_the_worker",
        ),
    ),
)


class CheckError(Exception):
    """The check itself cannot run (a stale mutation, a copy that imports the wrong code)."""


@dataclass
class Outcome:
    mutation: Mutation
    result: str  # caught, survived, broken
    caught_by: str
    seconds: float
    detail: str  # the failure's message when caught, what happened otherwise


# -- the copy --------------------------------------------------------------------------------

TOP_LEVEL_SKIPPED = {".venv", "venv", ".git", "build", "dist", "htmlcov", ".tox", ".nox"}
SKIPPED_ANYWHERE = (
    "__pycache__",
    "*.pyc",
    ".pytest_cache",
    ".mypy_cache",
    ".ruff_cache",
    ".hypothesis",
    "*.egg-info",
    ".coverage",
    ".coverage.*",
    "coverage.xml",
    "*.db",
    "*.db-wal",
    "*.db-shm",
    "node_modules",
)


def ignored(directory: str, names: list[str]) -> set[str]:
    skipped = set(shutil.ignore_patterns(*SKIPPED_ANYWHERE)(directory, names))
    if Path(directory) == ROOT:
        skipped |= TOP_LEVEL_SKIPPED & set(names)
        skipped |= {name for name in names if name.startswith("reliability-") and name.endswith(".md")}
    return skipped


def copy_service(into: Path) -> Path:
    """The service, and its kit where it is vendored (``kit/``); a kit installed from a package
    index is copied there, so its code can be mutated too."""
    copy = into / ROOT.name
    shutil.copytree(ROOT, copy, symlinks=True, ignore=ignored)
    if not (copy / KIT).is_dir():
        shutil.copytree(Path(outbox_kit.__file__).parent, copy / KIT, ignore=ignored)
    return copy


def package_name(root: Path) -> str:
    packages = [p.name for p in (root / "src").iterdir() if (p / "__init__.py").is_file()]
    if len(packages) != 1:
        msg = f"expected one package under {root / 'src'}, found {packages}"
        raise CheckError(msg)
    return packages[0]


def environment(copy: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONHOME"}}
    env |= {
        "PYTHONPATH": os.pathsep.join(map(str, (copy / "src", copy / "kit" / "src", copy))),
        "ALEMBIC_CONFIG": str(copy / "alembic.ini"),  # the migrations come from the copy too
        "REQUIRE_SERVICES": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "COLUMNS": "400",  # room for the failure's message on pytest's FAILED summary line
    }
    return env


def verify_imports(copy: Path) -> None:
    """The copy's package and tests must be the ones imported, not the editable install."""
    probe = "import importlib, sys\nfor n in sys.argv[1:]: print(importlib.import_module(n).__file__)"
    names = [package_name(copy), "outbox_kit", "tests"]
    done = subprocess.run(
        [sys.executable, "-c", probe, *names],
        cwd=copy,
        env=environment(copy),
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    if done.returncode != 0:
        msg = f"the copy cannot import {names}: {done.stderr.strip()[-2000:]}"
        raise CheckError(msg)
    files = done.stdout.splitlines()[-len(names) :]  # the last lines: an import may print too
    if len(files) != len(names):
        msg = f"the import probe printed {done.stdout!r}, not the files of {names}"
        raise CheckError(msg)
    for name, file in zip(names, files, strict=True):
        if not Path(file).resolve().is_relative_to(copy.resolve()):
            msg = f"{name} is imported from {file}, not from the copy {copy}: the check would test nothing"
            raise CheckError(msg)


# -- mutations -------------------------------------------------------------------------------


def resolved(edit: Edit, package: str) -> str:
    return edit.path.format(package=package)


def stale_edits(mutation: Mutation, root: Path, package: str) -> list[str]:
    """Why each edit of ``mutation`` would not apply to ``root`` (empty when all apply)."""
    problems = []
    for edit in mutation.edits:
        path = root / resolved(edit, package)
        found = path.read_text(encoding="utf-8").count(edit.original) if path.is_file() else 0
        if found != 1:
            problems.append(
                f"mutation {mutation.name} no longer applies: {resolved(edit, package)} changed "
                f"(its original snippet occurs {found} times, not once)"
            )
    return problems


def apply(mutation: Mutation, copy: Path, package: str) -> None:
    for edit in mutation.edits:
        path = copy / resolved(edit, package)
        text = path.read_text(encoding="utf-8")
        if text.count(edit.original) != 1:
            msg = f"mutation {mutation.name} no longer applies: {resolved(edit, package)} changed"
            raise CheckError(msg)
        path.write_text(text.replace(edit.original, edit.replacement), encoding="utf-8")


# -- pytest ----------------------------------------------------------------------------------


@dataclass
class Run:
    code: int
    output: str
    seconds: float

    def first(self, kind: str) -> tuple[str, str]:
        """The node id and the message of the first ``FAILED``/``ERROR`` line of the short
        summary (``-rfE``); empty strings when there is none."""
        for line in self.output.splitlines():
            if line.startswith(f"{kind} "):
                node, _, message = line[len(kind) + 1 :].partition(" - ")
                return node.strip(), message.strip()[:400]
        return "", ""

    def tail(self, lines: int = 25) -> str:
        return "\n".join(self.output.rstrip().splitlines()[-lines:])


def run_pytest(copy: Path, selection: Sequence[str]) -> Run:
    command = [sys.executable, "-m", "pytest", "-p", "no:randomly", "-p", "no:cacheprovider"]
    command += ["-x", "-q", "-rfE", *selection]
    started = time.monotonic()
    try:
        done = subprocess.run(
            command,
            cwd=copy,
            env=environment(copy),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            check=False,
            timeout=RUN_TIMEOUT_SECONDS,
        )
    except subprocess.TimeoutExpired as expired:
        output = expired.stdout if isinstance(expired.stdout, str) else ""
        return Run(-1, f"{output}\ntimed out after {RUN_TIMEOUT_SECONDS}s", time.monotonic() - started)
    return Run(done.returncode, done.stdout, time.monotonic() - started)


def in_copy(work: Path, label: str) -> Path:
    """A fresh copy of the service under ``work/label``, checked to import itself."""
    place = work / label
    place.mkdir()
    copy = copy_service(place)
    verify_imports(copy)
    return copy


def baseline_groups(mutations: Sequence[Mutation]) -> list[list[str]]:
    """Plain node ids run together (deduplicated); a selection with options runs on its own."""
    ids: list[str] = []
    groups: list[list[str]] = []
    for mutation in mutations:
        if any(arg.startswith("-") for arg in mutation.selection):
            groups.append(list(mutation.selection))
        else:
            ids += [arg for arg in mutation.selection if arg not in ids]
    return [ids, *groups] if ids else groups


def run_baseline(mutations: Sequence[Mutation], work: Path) -> tuple[bool, str]:
    copy = in_copy(work, "baseline")
    seconds = 0.0
    for group in baseline_groups(mutations):
        print(f"baseline: {' '.join(group)}", flush=True)
        run = run_pytest(copy, group)
        seconds += run.seconds
        if run.code != 0:
            return False, f"the baseline failed (exit {run.code}, {run.seconds:.0f}s):\n{run.tail(40)}"
    return True, f"the baseline passed ({seconds:.0f}s)"


def run_mutation(mutation: Mutation, work: Path) -> Outcome:
    started = time.monotonic()
    copy = in_copy(work, mutation.name)
    apply(mutation, copy, package_name(copy))
    print(f"{mutation.name}: {' '.join(mutation.selection)}", flush=True)
    run = run_pytest(copy, mutation.selection)
    seconds = time.monotonic() - started
    if run.code == 0:
        return Outcome(mutation, "survived", "", seconds, f"every selected test passed:\n{run.tail(5)}")
    failed, message = run.first("FAILED")
    if run.code == 1 and failed:
        return Outcome(mutation, "caught", failed, seconds, message)
    errored, _ = run.first("ERROR")
    why = f"pytest exit {run.code}" + (f", error in {errored}" if errored else "")
    return Outcome(mutation, "broken", "", seconds, f"{why} (not a failed scenario):\n{run.tail()}")


# -- the report ------------------------------------------------------------------------------


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def mutation_table(outcomes: Sequence[Outcome], baseline: str) -> str:
    lines = [
        "# Reliability mutations",
        "",
        f"Baseline: {baseline}.",
        "",
        "| mutation | what it breaks | caught by | result | seconds |",
        "| --- | --- | --- | --- | ---: |",
    ]
    for o in outcomes:
        caught_by = f"`{o.caught_by}`" if o.caught_by else "-"
        lines.append(
            f"| {cell(o.mutation.name)} | {cell(o.mutation.breaks)} | {cell(caught_by)} "
            f"| {o.result} | {o.seconds:.0f} |"
        )
    caught = [o for o in outcomes if o.result == "caught"]
    if caught:
        lines += ["", "How each was caught (the first failure's message):", ""]
        lines += [f"* {o.mutation.name}: {o.detail or '(no message)'}" for o in caught]
    for o in outcomes:
        if o.result != "caught":
            lines += ["", f"## {o.mutation.name}: {o.result}", "", "```", o.detail, "```"]
    return "\n".join(lines) + "\n"


def publish(text: str, report: Path) -> None:
    print(text, flush=True)
    report.write_text(text, encoding="utf-8")
    print(f"written to {report}", flush=True)


# -- main ------------------------------------------------------------------------------------


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m outbox_kit.testing.reliability",
        description="The mutation check of the reliability tier.",
    )
    names = [m.name for m in MUTATIONS]
    parser.add_argument("--only", action="append", choices=names, metavar="NAME", help=", ".join(names))
    parser.add_argument("--report", type=Path, default=ROOT / DEFAULT_REPORT)
    parser.add_argument("--skip-baseline", action="store_true", help="skip the unmutated run (iterating)")
    parser.add_argument("--keep", action="store_true", help="leave the copies in the temporary directory")
    parser.add_argument("--jobs", type=int, default=1, metavar="N", help="mutations run at once (default 1)")
    return parser.parse_args(argv)


def reported(outcome: Outcome) -> Outcome:
    name = outcome.mutation.name
    print(f"{name}: {outcome.result} {outcome.caught_by} ({outcome.seconds:.0f}s)", flush=True)
    return outcome


def check(args: argparse.Namespace, work: Path) -> int:
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    package = package_name(ROOT)
    stale = [problem for m in chosen for problem in stale_edits(m, ROOT, package)]
    if stale:
        print("\n".join(stale), file=sys.stderr, flush=True)
        return 1
    baseline = "skipped (--skip-baseline)"
    if not args.skip_baseline:
        passed, baseline = run_baseline(chosen, work)
        if not passed:
            publish(mutation_table([], baseline), args.report)
            return 1
    # Each mutation runs in its own copy, test database and broker namespace, so several can
    # run at once; most of a scenario's time is spent waiting for leases, restarts and timeouts.
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        outcomes = list(pool.map(lambda mutation: reported(run_mutation(mutation, work)), chosen))
    publish(mutation_table(outcomes, baseline), args.report)
    return 0 if all(o.result == "caught" for o in outcomes) else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    work = Path(tempfile.mkdtemp(prefix="reliability-mutations-"))
    try:
        return check(args, work)
    except CheckError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 1
    finally:
        if args.keep:
            print(f"copies kept in {work}", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
