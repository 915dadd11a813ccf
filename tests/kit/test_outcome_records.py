"""Every claimed row ends with an outcome written: even when the failure's own text cannot be
stored, after a replay, when the lease was lost, or when the process shuts down.

A row whose outcome cannot be recorded is the worst failure an outbox can have: it is neither
delivered nor charged, so it comes back after its lease, fails the same way, and blocks its
ordering key forever.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from outbox_kit.persistence.tables import (
    OUTBOX_TABLE,
)
from outbox_kit.processor.claim import ClaimedRow
from outbox_kit.runtime.container import OutboxContainer
from outbox_kit.testing.harness import FakeClock, ScriptedDeliverer, insert_rows, outbox_source, row, state
from outbox_kit.transports.bus import Delivered
from sqlalchemy.exc import DataError

pytestmark = pytest.mark.integration


def raising(error: BaseException) -> ScriptedDeliverer:
    async def fail(claimed: ClaimedRow) -> Delivered:
        del claimed
        raise error

    return ScriptedDeliverer(fail)


@pytest.mark.parametrize("text", ["a NUL \x00 in the message", "a lone \ud800 surrogate"])
async def test_a_failure_whose_text_cannot_be_stored_is_recorded_cleaned_and_charged(
    container: OutboxContainer, text: str
) -> None:
    """PostgreSQL refuses NUL in text and no driver encodes a lone surrogate: stored as they
    come, the outcome write itself fails and the row loops uncharged. The text is cleaned
    (valid UTF-8, no NUL) and the retry is charged, on both databases."""
    clock = FakeClock()
    (row_id,) = await insert_rows(container, [row("kit.a.v1", clock.now)])
    source = outbox_source(container, raising(RuntimeError(text)), clock)
    await source.run_cycle()
    failed = await state(container, row_id)
    assert failed.retry_count == 1
    assert failed.last_error.startswith("RuntimeError: a ")
    assert "\x00" not in failed.last_error
    failed.last_error.encode("utf-8")  # strict: no lone surrogate survived


class Unprintable(Exception):  # noqa: N818 (named for what it does to a log line)
    def __str__(self) -> str:
        msg = "this error cannot describe itself"
        raise RuntimeError(msg)


async def test_a_failure_that_cannot_even_be_described_is_charged(container: OutboxContainer) -> None:
    clock = FakeClock()
    (row_id,) = await insert_rows(container, [row("kit.a.v1", clock.now)])
    await outbox_source(container, raising(Unprintable()), clock).run_cycle()
    failed = await state(container, row_id)
    assert failed.retry_count == 1
    assert failed.last_error.startswith("Unprintable")


async def test_an_outcome_write_the_database_refuses_is_recorded_with_a_plain_reason(
    container: OutboxContainer,
) -> None:
    """The failure write is refused for a reason other than an outage (here: the database said
    the value is invalid). Looping would retry the row uncharged forever; instead a plain
    reason is written and the retry is charged."""
    clock = FakeClock()
    (row_id,) = await insert_rows(container, [row("kit.a.v1", clock.now)])
    source = outbox_source(container, raising(ValueError("the handler's own failure")), clock)
    original = source.leases.record_failure
    refused: list[str] = []

    async def refuses_the_first_text(*args: Any, **kwargs: Any) -> bool:
        if not refused:
            refused.append(kwargs["error"])
            raise DataError("UPDATE outbox_messages ...", {}, Exception("invalid input value"))
        return await original(*args, **kwargs)

    source.leases.record_failure = refuses_the_first_text  # type: ignore[method-assign]
    await source.run_cycle()
    failed = await state(container, row_id)
    assert refused == ["ValueError: the handler's own failure"]
    assert failed.retry_count == 1
    assert failed.last_error.startswith("ValueError (the failure's text could not be recorded: DataError")


async def test_a_replayed_row_gets_its_one_retry_for_an_unresolvable_name_again(
    container: OutboxContainer,
) -> None:
    """The first miss is transient (a module still loading in a rolling deploy); replay keeps
    ``last_error``, and a miss from before the replay must not make the next one terminal."""
    clock = FakeClock()
    (row_id,) = await insert_rows(container, [row("kit.never-registered.v1", clock.now)])
    source = outbox_source(container, container.outbox_deliverer(), clock)
    for _ in range(2):
        await source.run_cycle()
        clock.advance(3600)
    assert (await state(container, row_id)).dead_letter_reason == "type_unresolvable"

    await container.admin().replay("outbox", [str(row_id)], actor="test")
    await source.run_cycle()
    after_replay = await state(container, row_id)
    assert (after_replay.retry_count, after_replay.dead_lettered_on) == (1, None)
    clock.advance(3600)
    await source.run_cycle()
    assert (await state(container, row_id)).dead_letter_reason == "type_unresolvable"


async def test_a_stamp_that_finds_its_lease_lost_is_not_progress(container: OutboxContainer) -> None:
    """The only row of the cycle was published, but another replica owns it now: this cycle
    completed nothing, so it must not make the loop re-poll at once."""
    clock = FakeClock()
    (row_id,) = await insert_rows(container, [row("kit.a.v1", clock.now)])

    async def published_then_taken_over(claimed: ClaimedRow) -> Delivered:
        await take_over(container, claimed.id)
        return Delivered.NEEDS_STAMP

    source = outbox_source(container, ScriptedDeliverer(published_then_taken_over), clock, batch_size=1)
    cycle = await source.run_cycle()
    assert (cycle.claimed, cycle.completed, cycle.poll_again_now) == (1, 0, False)
    assert (await state(container, row_id)).processed_on is None


async def take_over(container: OutboxContainer, row_id: uuid.UUID) -> None:
    async with container.database().session() as session:
        await session.exec(  # type: ignore[call-overload]
            OUTBOX_TABLE.update().where(OUTBOX_TABLE.c.id == row_id).values(lock_token=uuid.uuid4())
        )
        await session.commit()


async def test_unreached_rows_are_released_even_when_an_outcome_write_uses_the_whole_deadline(
    container: OutboxContainer,
) -> None:
    """Shutdown while one row's stamp hangs (its write waits on a lock, say): the rows the
    cycle never reached are released at once, not after the hanging write used up the
    shutdown timeout (they would then wait out the whole lease)."""
    clock = FakeClock()
    hanging, *unreached = await insert_rows(container, [row("kit.a.v1", clock.now) for _ in range(3)])
    source = outbox_source(
        container, ScriptedDeliverer(), clock, delivery_concurrency=1, shutdown_timeout_seconds=1.0
    )
    original = source.leases.stamp_processed
    writing = asyncio.Event()

    async def hangs_for_the_first_row(connection: Any, ids: Any, *args: Any, **kwargs: Any) -> Any:
        if hanging in ids:
            writing.set()
            await asyncio.sleep(30)
        return await original(connection, ids, *args, **kwargs)

    source.leases.stamp_processed = hangs_for_the_first_row  # type: ignore[method-assign]
    cycle = asyncio.create_task(source.run_cycle())
    await asyncio.wait_for(writing.wait(), 10)
    cycle.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cycle
    for row_id in unreached:
        released = await state(container, row_id)
        assert (released.lock_token, released.locked_until, released.retry_count) == (None, None, 0)
