"""Cleanup, administration, metrics and internal commands (issue: processor and operations)."""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import logging
import time
import uuid
from datetime import timedelta
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from outbox_kit.operations.rows import AdminError
from outbox_kit.persistence.tables import (
    COMMAND_TABLE,
    DeadLetterReplay,
    InboxMessage,
    InternalCommandRow,
)
from outbox_kit.persistence.unit_of_work import SqlUnitOfWork
from outbox_kit.processor.claim import ClaimedRow
from outbox_kit.processor.processor import (
    Processor,
)
from outbox_kit.runtime.container import OutboxContainer
from outbox_kit.runtime.settings import ServiceSettings
from outbox_kit.testing.fixtures import acting_as, fetch, live_server, token_for
from outbox_kit.testing.harness import (
    FakeClock,
    RecordEffect,
    ScriptedDeliverer,
    all_rows,
    command_source,
    insert_rows,
    install_kit,
    outbox_source,
    record_effect,
    row,
    state,
)
from outbox_kit.transports.bus import Delivered
from prometheus_client import generate_latest
from sqlmodel import select

pytestmark = pytest.mark.integration


async def test_cleanup_deletes_exactly_what_is_past_retention(
    make_container: Any, caplog: pytest.LogCaptureFixture
) -> None:
    container = make_container(
        outbox={"retention_days": 7, "dead_letter_retention_days": 30}, inbox={"retention_days": 2}
    )
    now = container.clock()()
    days = timedelta(days=1)
    keep = await insert_rows(
        container,
        [
            row("kit.a.v1", now - 6 * days, processed_on=now),  # processed, young
            row("kit.a.v1", now - 20 * days, processed_on=now - days),  # old event, delivered late
            row("kit.a.v1", now - 20 * days, dead_lettered_on=now, dead_letter_reason="x"),  # dead, < 30 d
            # replayed long after it happened, then dead-lettered again two days ago:
            row("kit.a.v1", now - 90 * days, dead_lettered_on=now - 2 * days, dead_letter_reason="x"),
            row("kit.a.v1", now - 90 * days),  # still pending: never
        ],
    )
    gone = await insert_rows(
        container,
        [
            row("kit.a.v1", now - 8 * days, processed_on=now - 8 * days),
            row("kit.a.v1", now - 31 * days, dead_lettered_on=now - 31 * days, dead_letter_reason="x"),
        ],
    )
    async with container.database().session() as session:
        session.add(InboxMessage(message_id="old", consumer="c", event_name="e", received_on=now - 3 * days))
        session.add(InboxMessage(message_id="new", consumer="c", event_name="e", received_on=now - days / 2))
        await session.commit()
    with caplog.at_level(logging.WARNING):
        counts = await container.cleaner().sweep()
    remaining = {r.id for r in await all_rows(container)}
    assert remaining == set(keep)
    assert not remaining & set(gone)
    inbox = await fetch(container, sa.select(InboxMessage.__table__.c.message_id))  # type: ignore[attr-defined]
    assert [r[0] for r in inbox] == ["new"]
    assert counts["outbox:processed"] == 1
    assert counts["outbox:dead_lettered"] == 1
    assert counts["inbox:consumed"] == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "retention cleanup deleted 1 processed and 1 dead_lettered row(s) from outbox" in warnings
    assert "retention cleanup deleted 1 consumed row(s) from inbox" in warnings
    assert len([w for w in warnings if "retention cleanup" in w]) == 2  # one per table, not per state


async def test_cleanup_covers_internal_commands_and_falls_back_to_retention_days(
    make_container: Any,
) -> None:
    """``OUTBOX__DEAD_LETTER_RETENTION_DAYS=0`` means "as long as processed rows"; the command
    table is swept by the same rules."""
    container = make_container(outbox={"retention_days": 3, "dead_letter_retention_days": 0})
    now = container.clock()()
    old, young = now - timedelta(days=4), now - timedelta(days=2)
    await insert_rows(
        container,
        [
            row("kit.a.v1", old, dead_lettered_on=old, dead_letter_reason="x"),
            row("kit.a.v1", young, dead_lettered_on=young, dead_letter_reason="x"),
        ],
    )
    commands = [
        {"command_name": "kit.record-effect.v1", "payload": {}, "occurred_on": at, "available_on": at}
        | {"processed_on": at, "retry_count": 0}
        for at in (old, young)
    ]
    await insert_rows(container, commands, InternalCommandRow.__table__)  # type: ignore[attr-defined]
    counts = await container.cleaner().sweep()
    assert counts["outbox:dead_lettered"] == 1
    assert counts["internal_commands:processed"] == 1
    assert [r.dead_lettered_on for r in await all_rows(container)] == [young]
    remaining = await fetch(container, select(InternalCommandRow))
    assert [c.processed_on for c in remaining] == [young]


async def test_cleanup_in_batches_removes_everything_due(make_container: Any) -> None:
    container = make_container(outbox={"retention_days": 1, "cleanup_batch_size": 7})
    old = container.clock()() - timedelta(days=3)
    await insert_rows(container, [row("kit.a.v1", old, processed_on=old) for _ in range(30)])
    assert (await container.cleaner().sweep())["outbox:processed"] == 30
    assert await all_rows(container) == []


async def test_retention_zero_disables_cleanup(make_container: Any) -> None:
    container = make_container(outbox={"retention_days": 0})
    old = container.clock()() - timedelta(days=300)
    await insert_rows(container, [row("kit.a.v1", old, processed_on=old)])
    await container.cleaner().sweep()
    assert len(await all_rows(container)) == 1


async def dead_letter(container: OutboxContainer, count: int, **extra: Any) -> list[uuid.UUID]:
    now = container.clock()()
    return await insert_rows(
        container,
        [
            row(
                "kit.a.v1",
                now - timedelta(minutes=count - i),
                dead_lettered_on=now,
                dead_letter_reason="retries_exhausted",
                retry_count=5,
                last_error=f"boom {i}",
                payload={"secret": "personal data"},
                **extra,
            )
            for i in range(count)
        ],
    )


async def test_dead_letters_are_listed_oldest_first_paged_without_payload(container: OutboxContainer) -> None:
    ids = await dead_letter(container, 5)
    admin = container.admin()
    first = await admin.list_dead_letters("outbox", offset=0, limit=2)
    second = await admin.list_dead_letters("outbox", offset=2, limit=2)
    assert [d.id for d in first + second] == [str(i) for i in ids[:4]]
    assert all(not hasattr(d, "payload") for d in first)
    assert first[0].reason == "retries_exhausted"
    assert await admin.list_dead_letters(None, limit=50) == await admin.list_dead_letters("outbox", limit=50)
    with pytest.raises(AdminError, match="unknown source 'nope'"):
        await admin.list_dead_letters("nope")


async def test_replay_resets_retries_clears_the_lease_keeps_error_and_place(
    container: OutboxContainer,
) -> None:
    ids = await dead_letter(container, 2, ordering_key="k")
    before = await state(container, ids[0])
    result = await container.admin().replay("outbox", [str(ids[0])], actor="operator-1")
    assert result.replayed == [str(ids[0])]
    after = await state(container, ids[0])
    assert (after.retry_count, after.dead_lettered_on, after.locked_until, after.lock_token) == (
        0,
        None,
        None,
        None,
    )
    assert after.last_error == before.last_error
    assert (after.occurred_on, after.seq) == (before.occurred_on, before.seq)
    (audit,) = await fetch(container, sa.select(DeadLetterReplay.__table__))  # type: ignore[attr-defined]
    assert (audit.replayed_by, audit.message_count, audit.message_ids) == ("operator-1", 1, [str(ids[0])])
    claimed = await outbox_source(container, ScriptedDeliverer()).claim(uuid.uuid4())
    assert [r.id for r in claimed] == [ids[0]]  # back in the pool, first in its key


async def test_replay_is_all_or_nothing_with_clear_errors(container: OutboxContainer) -> None:
    (dead,) = await dead_letter(container, 1)
    (alive,) = await insert_rows(container, [row("kit.a.v1", container.clock()())])
    admin = container.admin()
    with pytest.raises(AdminError, match="no outbox row has id"):
        await admin.replay("outbox", [str(dead), str(uuid.uuid4())], actor="op")
    with pytest.raises(AdminError, match="not dead-lettered"):
        await admin.replay("outbox", [str(dead), str(alive)], actor="op")
    with pytest.raises(AdminError, match="is not a row id"):
        await admin.replay("outbox", ["not-a-uuid"], actor="op")
    with pytest.raises(AdminError, match="needs one source"):
        await admin.replay("all", [str(dead)], actor="op")
    assert (await state(container, dead)).dead_lettered_on is not None


async def test_count_pending_includes_leased_rows(container: OutboxContainer) -> None:
    now = container.clock()()
    await insert_rows(container, [row("kit.a.v1", now) for _ in range(3)])
    await dead_letter(container, 1)
    await outbox_source(container, ScriptedDeliverer()).claim(uuid.uuid4())  # leases the 3
    (outbox, commands) = await container.admin().count_pending()
    assert (outbox.source, outbox.pending, outbox.leased, outbox.dead_lettered) == ("outbox", 3, 3, 1)
    assert (commands.source, commands.pending) == ("internal_commands", 0)


async def test_explain_says_why_a_row_is_or_is_not_moving(container: OutboxContainer) -> None:
    clock = FakeClock()
    head, follower = await insert_rows(container, [row("kit.a.v1", clock.now, key="k") for _ in range(2)])
    (future,) = await insert_rows(
        container, [row("kit.a.v1", clock.now, available_on=clock.now + timedelta(hours=1))]
    )
    (dead,) = await dead_letter(container, 1)
    admin = container.admin()
    assert (await admin.explain("outbox", str(follower))).state == "blocked"
    assert str(head) in (await admin.explain("outbox", str(follower))).detail
    assert (await admin.explain("outbox", str(future))).state == "delayed"
    assert (await admin.explain("outbox", str(head))).state == "pending"
    source = outbox_source(container, ScriptedDeliverer(), clock)
    await source.claim(uuid.uuid4())
    leased = await admin.explain("outbox", str(head))
    assert leased.state == "leased"
    assert "processor-a" in leased.detail
    explained = await admin.explain("outbox", str(dead))
    assert (explained.state, explained.retry_count) == ("dead_lettered", 5)
    assert "retries_exhausted" in explained.detail
    with pytest.raises(AdminError, match="no outbox row has id"):
        await admin.explain("outbox", str(uuid.uuid4()))


async def test_explain_reports_backoff_and_processed(container: OutboxContainer) -> None:
    clock = FakeClock()
    (row_id,) = await insert_rows(container, [row("kit.a.v1", clock.now)])

    async def fails(_row: Any) -> Any:
        raise ConnectionError("down")

    source = outbox_source(container, ScriptedDeliverer(fails), clock)
    await source.run_cycle()
    backing_off = await container.admin().explain("outbox", str(row_id))
    assert backing_off.state == "backing_off"
    assert "after attempt 1" in backing_off.detail
    clock.advance(3600)
    await outbox_source(container, ScriptedDeliverer(), clock).run_cycle()
    assert (await container.admin().explain("outbox", str(row_id))).state == "processed"


async def test_metrics_agree_with_the_table(container: OutboxContainer) -> None:
    """Each metric against the rows it describes: a leased row and a dead letter are not part of
    the deliverable backlog's age, the depth counts leased rows, every outcome is counted."""
    clock = FakeClock()
    now = clock.now
    other_processor = {"locked_until": now + timedelta(minutes=5), "lock_token": uuid.uuid4()}
    leased, old_dead = await insert_rows(
        container,
        [
            row("kit.a.v1", now - timedelta(seconds=300), **other_processor),
            row("kit.a.v1", now - timedelta(seconds=1000), dead_lettered_on=now, dead_letter_reason="x"),
        ],
    )
    delivered, failing = await insert_rows(
        container,
        [row("kit.a.v1", now - timedelta(seconds=90)), row("kit.a.v1", now - timedelta(seconds=30))],
    )

    async def fail_one(claimed: ClaimedRow) -> Delivered:
        if claimed.id == failing:
            msg = "downstream refused"
            raise ConnectionError(msg)
        return Delivered.NEEDS_STAMP

    source = outbox_source(container, ScriptedDeliverer(fail_one), clock, max_retries=1)
    await source.run_cycle()
    registry = container.metrics().registry

    def sample(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"source": "outbox", **labels})

    assert sample("outbox_oldest_pending_age_seconds") == pytest.approx(90)
    assert sample("outbox_dispatched_total", kind="integration") == 1
    assert sample("outbox_failures_total") == 1
    assert sample("outbox_dead_letters_total", reason="retries_exhausted") == 1
    assert sample("outbox_dispatch_lag_seconds_count") == 1
    assert sample("outbox_dispatch_lag_seconds_sum") == pytest.approx(90)
    assert sample("outbox_processor_heartbeat_timestamp_seconds") == pytest.approx(now.timestamp())
    assert sample("outbox_lost_leases_total") in (None, 0)
    await container.worker().sample_depth()
    (pending,) = await container.admin().count_pending("outbox")
    assert sample("outbox_pending_depth") == pending.pending == 1  # the leased row only
    assert (await state(container, leased)).processed_on is None
    assert (await state(container, delivered)).processed_on is not None
    assert (await state(container, old_dead)).dead_lettered_on is not None
    await source.run_cycle()  # nothing claimable: the age drops to 0, not to a stale value
    assert sample("outbox_oldest_pending_age_seconds") == 0
    exposition = generate_latest(registry).decode()
    for name in (
        "outbox_pending_depth",
        "outbox_oldest_pending_age_seconds",
        "outbox_dispatch_lag_seconds",
        "outbox_dispatched_total",
        "outbox_dead_letters_total",
        "outbox_processor_heartbeat_timestamp_seconds",
        "inbox_duplicates_total",
    ):
        assert name in exposition


async def test_internal_commands_run_later_in_their_own_unit_of_work(container: OutboxContainer) -> None:
    kit = await install_kit(container)
    seen: list[tuple[str | None, str]] = []

    async def run_command(command: RecordEffect, uow: SqlUnitOfWork) -> None:
        from outbox_kit.application.context import (
            current_context,
        )

        seen.append((current_context().tenant_id, current_context().authentication_type or ""))
        await record_effect(uow, command.label)

    container.handlers().on_command(RecordEffect, run_command)
    with acting_as(tenant="globex"):
        async with container.units_of_work()() as uow:
            uow.schedule(RecordEffect(label="follow-up"))
            await uow.commit()
    (commands,) = [s for s in container.sources() if s.name == "internal_commands"]
    await commands.run_cycle()
    assert seen == [("globex", "internal-command")]
    assert await kit.effects() == ["follow-up"]
    (command_row,) = await fetch(container, sa.select(COMMAND_TABLE))
    assert command_row.processed_on is not None


async def test_a_command_due_later_runs_on_time_not_one_interval_late(container: OutboxContainer) -> None:
    """``schedule(command, due_at=...)``: the commit wakes the loop, whose smart wait then sleeps
    until the due time; the 30 s fallback interval would make it half a minute late."""
    await install_kit(container)
    ran_at: list[float] = []

    async def run_command(command: RecordEffect, uow: SqlUnitOfWork) -> None:
        ran_at.append(time.monotonic())
        await record_effect(uow, command.label)

    container.handlers().on_command(RecordEffect, run_command)
    (commands,) = [s for s in container.sources() if s.name == "internal_commands"]
    wake = container.wake().subscribe()
    loop = Processor(commands, wake=wake, interval_seconds=30, clock=container.clock())
    task = asyncio.create_task(loop.run())
    try:
        await asyncio.sleep(0.3)  # the loop is idle, waiting out its 30 s interval
        due = time.monotonic() + 1.0  # the same moment as due_at, on the monotonic clock
        with acting_as():
            async with container.units_of_work()() as uow:
                uow.schedule(RecordEffect(label="later"), due_at=container.clock()() + timedelta(seconds=1))
                await uow.commit()
        while not ran_at and time.monotonic() < due + 10:
            await asyncio.sleep(0.02)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert ran_at, "the command waited for the 30 s fallback interval"
    assert due - 0.05 <= ran_at[0] < due + 2.0  # not early, and not an interval late


async def test_a_failing_internal_command_backs_off_like_the_outbox(container: OutboxContainer) -> None:
    await install_kit(container)

    async def broken(command: RecordEffect, uow: SqlUnitOfWork) -> None:
        await record_effect(uow, "never kept")
        raise RuntimeError("command failed")

    container.handlers().on_command(RecordEffect, broken)
    with acting_as():
        async with container.units_of_work()() as uow:
            uow.schedule(RecordEffect(label="x"))
            await uow.commit()
    (commands,) = [s for s in container.sources() if s.name == "internal_commands"]
    await commands.run_cycle()
    (command_row,) = await fetch(container, sa.select(COMMAND_TABLE))
    assert (command_row.retry_count, command_row.processed_on) == (1, None)
    assert "command failed" in command_row.last_error
    assert command_row.locked_until > container.clock()()


async def test_a_command_that_keeps_failing_is_dead_lettered_after_exactly_max_retries(
    container: OutboxContainer,
) -> None:
    """The internal-command processor uses the outbox's idiom: backoff, then ``retries_exhausted``
    at ``OUTBOX__MAX_RETRIES`` (3 here), never a fourth run."""
    await install_kit(container)
    runs: list[str] = []

    async def broken(command: RecordEffect, uow: SqlUnitOfWork) -> None:
        del uow
        runs.append(command.label)
        msg = "the mail server refused it"
        raise RuntimeError(msg)

    container.handlers().on_command(RecordEffect, broken)
    clock = FakeClock()
    with acting_as():
        async with container.units_of_work()() as uow:
            uow.schedule(RecordEffect(label="welcome-mail"), due_at=clock.now)
            await uow.commit()
    source = command_source(container, clock, max_retries=3)
    for _ in range(5):
        await source.run_cycle()
        clock.advance(3600)  # past any backoff
    (command_row,) = await fetch(container, sa.select(COMMAND_TABLE))
    assert runs == ["welcome-mail"] * 3
    assert (command_row.retry_count, command_row.dead_letter_reason) == (3, "retries_exhausted")
    assert "the mail server refused it" in command_row.last_error
    (listed,) = await container.admin().list_dead_letters("internal_commands")
    assert listed.reason == "retries_exhausted"


async def test_a_command_nobody_can_read_is_retried_once_then_dead_lettered(
    container: OutboxContainer,
) -> None:
    clock = FakeClock()
    (command_id,) = await insert_rows(
        container,
        [
            {
                "command_name": "kit.never-registered.v1",
                "payload": {},
                "occurred_on": clock.now,
                "available_on": clock.now,
                "retry_count": 0,
            }
        ],
        table=COMMAND_TABLE,
    )
    source = command_source(container, clock)
    await source.run_cycle()
    first = await state(container, command_id, table=COMMAND_TABLE)
    assert (first.retry_count, first.dead_lettered_on) == (1, None)
    clock.advance(3600)
    await source.run_cycle()
    second = await state(container, command_id, table=COMMAND_TABLE)
    assert (second.retry_count, second.dead_letter_reason) == (2, "type_unresolvable")


async def test_the_admin_api_lists_explains_and_replays_as_the_callers_identity(
    container: OutboxContainer,
) -> None:
    """Over a real HTTP server: the replay is recorded as the token's subject (not a name the
    body chose), explain follows the row, and mistakes get 404/409/422 with the reason."""
    (dead,) = await dead_letter(container, 1, tenant_id="acme")  # the token's tenant (admins are scoped)
    headers = {"Authorization": f"Bearer {token_for(container, user='ops-ann', roles=('outbox-admin',))}"}
    async with (
        live_server(container, with_worker=False) as base,
        httpx.AsyncClient(base_url=base, headers=headers) as client,
    ):
        listed = (await client.get("/admin/outbox/dead-letters", params={"source": "outbox"})).json()
        before = (await client.get(f"/admin/outbox/outbox/{dead}/explain")).json()
        chosen_actor = await client.post(
            "/admin/outbox/dead-letters/replay", json={"ids": [str(dead)], "replayed_by": "someone-else"}
        )
        replayed = await client.post("/admin/outbox/dead-letters/replay", json={"ids": [str(dead)]})
        after = (await client.get(f"/admin/outbox/outbox/{dead}/explain")).json()
        again = await client.post("/admin/outbox/dead-letters/replay", json={"ids": [str(dead)]})
        unknown = await client.post("/admin/outbox/dead-letters/replay", json={"ids": [str(uuid.uuid4())]})
        bad_page = await client.get("/admin/outbox/dead-letters", params={"limit": 0})
        bad_source = await client.get(f"/admin/outbox/elsewhere/{dead}/explain")

    assert [(d["id"], d["reason"], d["last_error"]) for d in listed] == [
        (str(dead), "retries_exhausted", "boom 0")
    ]
    assert all("payload" not in d and "personal data" not in str(d) for d in listed)
    assert (before["state"], after["state"]) == ("dead_lettered", "pending")
    assert after["last_error"] == "boom 0"  # kept: the first thing anyone asks after a replay
    assert chosen_actor.status_code == 422  # the body cannot name who replays
    assert replayed.status_code == 200
    assert (replayed.json()["replayed"], replayed.json()["replayed_by"]) == ([str(dead)], "ops-ann")
    (audit,) = await fetch(container, sa.select(DeadLetterReplay.__table__))  # type: ignore[attr-defined]
    assert (audit.replayed_by, audit.message_count) == ("ops-ann", 1)
    assert (again.status_code, unknown.status_code, bad_page.status_code) == (409, 404, 422)
    assert "nothing to replay: not dead-lettered" in again.json()["detail"]
    assert "no outbox row has id" in unknown.json()["detail"]
    assert bad_source.status_code == 422  # the schema names the two sources
    assert "'outbox' or 'internal_commands'" in bad_source.json()["detail"][0]["msg"]


def test_the_cli_records_the_operators_login_name_by_default() -> None:
    from outbox_kit.runtime.cli import build_parser

    args = build_parser(ServiceSettings).parse_args(
        ["outbox", "replay", "--source", "outbox", str(uuid.uuid4())]
    )
    assert args.actor == f"cli:{getpass.getuser()}"


async def test_concurrent_replays_of_one_row_replay_it_once_and_the_rest_answer_409(
    container: OutboxContainer,
) -> None:
    """A dozen operators replay one dead letter at once over the real HTTP API: one of them
    replays it (200, naming the row, one audit row); every other one replayed nothing and says
    so (409, the reason, no audit row), never a 200 with an empty list."""
    (dead,) = await dead_letter(container, 1, tenant_id="acme")
    headers = {"Authorization": f"Bearer {token_for(container, user='ops-ann', roles=('outbox-admin',))}"}
    async with (
        live_server(container, with_worker=False) as base,
        httpx.AsyncClient(base_url=base, headers=headers, timeout=60) as client,
    ):
        answers = await asyncio.gather(
            *(client.post("/admin/outbox/dead-letters/replay", json={"ids": [str(dead)]}) for _ in range(12))
        )
        schema = (await client.get("/openapi.json")).json()

    statuses = sorted(answer.status_code for answer in answers)
    assert statuses == [200] + [409] * 11, [(a.status_code, a.text) for a in answers]
    (replayed,) = [answer.json() for answer in answers if answer.status_code == 200]
    assert replayed["replayed"] == [str(dead)]
    for refused in (answer.json() for answer in answers if answer.status_code == 409):
        assert refused["detail"].startswith("nothing to replay"), refused
        assert str(dead) in refused["detail"]
    audits = await fetch(container, sa.select(DeadLetterReplay.__table__))  # type: ignore[attr-defined]
    assert [(audit.message_count, audit.message_ids) for audit in audits] == [(1, [str(dead)])]
    assert (await state(container, dead)).dead_lettered_on is None
    documented = schema["paths"]["/admin/outbox/dead-letters/replay"]["post"]["responses"]
    assert "409" in documented
