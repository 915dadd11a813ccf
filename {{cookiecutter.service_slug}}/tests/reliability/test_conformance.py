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
import dataclasses
import itertools
import json
import random
import statistics
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import sqlalchemy as sa
from outbox_kit.operations.rows import EVERY_TENANT
from outbox_kit.persistence.tables import (
    OUTBOX_TABLE,
)
from outbox_kit.testing.brokers import (
    LEFTOVERS,
    PUBLISH_RAW,
    HostileBatch,
    dead_letters_of,
    hostile_messages,
)
from outbox_kit.testing.fixtures import SERVICE_URLS, fetch
from outbox_kit.testing.harness import DELIVERIES, TcpProxy, tcp_proxy
from outbox_kit.transports.envelope import Signer
from sqlalchemy.engine import make_url

from {{ cookiecutter.package_name }}.container import Container

from .conformance import (
    Fleet,
    Sent,
    all_received,
    assert_keys_flowed_in_order,
    check_delivery,
    cycling,
    declared_topology,
    outbox_rows,
    received,
    wait_until,
    write_events,
)
from .service_actor import CRASHED_AFTER_PUBLISH, HANDLER_POISON, LEDGER, RELAY_POISON

pytestmark = [pytest.mark.reliability, pytest.mark.slow, pytest.mark.postgres]
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

    container: Container
    fleet: Fleet
    began: float

    async def check(self, scenario: str, sent: list[Any], notes: str = "") -> None:
        await check_delivery(
            self.container, sent, self.fleet, scenario=scenario, began=self.began, notes=notes
        )


MakeStage = Callable[..., Awaitable[Stage]]


@pytest.fixture
async def stage(postgres_url: str, tmp_path: Path) -> AsyncIterator[MakeStage]:
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
                declared_topology(postgres_url, namespace, LEDGER, bus, fresh_tables=True)
            )
            fleet = Fleet(
                tmp_path,
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
    # Only its relay is frozen: a frozen consumer would hold its prefetched messages as well.
    await start_workers(scene.fleet, "other")
    await start_workers(scene.fleet, "frozen", options=("--relay-only", "--after-publish-seconds", "0.2"))
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


async def _nothing_pending(container: Container) -> bool:
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
    assert max(r.retry_count for r in rows) == 0, "an outage was charged to the rows"
    # Paused, it claims at most about once per polling interval (0.2 s); a spinning relay
    # claims hundreds of times a second.
    assert claims <= 2 * outage / 0.2, f"{claims} claims in {outage} s: the relay spun"


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
    sent = await write_events(scene.container, 1000, per_commit=50)
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


async def _dead(container: Container, row_id: uuid.UUID) -> bool:
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


def hostile_extras(container: Container, batch: HostileBatch) -> None:
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


async def oldest_pending_age(container: Container) -> float:
    c = OUTBOX_TABLE.c
    query = sa.select(sa.func.min(c.occurred_on)).where(
        c.processed_on.is_(None), c.dead_lettered_on.is_(None)
    )
    (row,) = await fetch(container, query)
    return 0.0 if row[0] is None else (datetime.now(UTC) - row[0]).total_seconds()


# -- 5. the database drops every connection, or restarts -------------------------------------


async def terminate_backends(container: Container) -> int:
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
