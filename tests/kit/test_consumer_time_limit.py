"""The consumer's time limit (``MESSAGE_BUS__HANDLER_TIMEOUT_SECONDS``) covers the handler, never
the commit: a message whose inbox row committed is never failed by it, whatever the commit does
after the handler returned (here, the in-process dispatch of a domain event the handler raised,
which runs under the delivery's own limits). Every broker transport, and the in-process one."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import sqlalchemy as sa
from outbox_kit.persistence.tables import INBOX_TABLE, OUTBOX_TABLE
from outbox_kit.persistence.unit_of_work import SqlUnitOfWork
from outbox_kit.runtime.container import OutboxContainer
from outbox_kit.testing.fixtures import ContainerFactory, acting_as, eventually, fetch
from outbox_kit.testing.harness import (
    CONSUMER,
    Counter,
    CounterChangedV1,
    Counters,
    Noted,
    install_kit,
    record_effect,
)
from test_brokers import TRANSPORTS, Observer, Start, effects_become, effects_of, envelope
from test_brokers import start as start  # the fixture  # noqa: PLC0414

pytestmark = pytest.mark.integration
LIMIT = 1.0
AFTER_COMMIT = 3.0  # the after-commit dispatch outlasts the handler's limit, not the delivery's


class RaisesASlowEvent(Observer):
    """A quick consumer whose commit dispatches a domain event in-process (slow, see below)."""

    async def __call__(self, event: CounterChangedV1, uow: SqlUnitOfWork) -> None:
        await super().__call__(event, uow)
        counter = Counter.create("acme")
        counter.note(f"after:{event.value}")
        uow.repository(Counters).add(counter)


def slow_domain_handler(container: OutboxContainer) -> list[str]:
    """Register a domain handler that takes ``AFTER_COMMIT`` seconds; returns its runs."""
    runs: list[str] = []

    async def slow(event: Noted, uow: SqlUnitOfWork) -> None:
        runs.append(event.text)
        await asyncio.sleep(AFTER_COMMIT)
        await record_effect(uow, f"noted:{event.text}")

    container.handlers().on_domain_event(Noted, slow)
    return runs


async def inbox_rows(container: OutboxContainer) -> list[Any]:
    return await fetch(container, sa.select(INBOX_TABLE))


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_slow_after_commit_dispatch_never_fails_a_consumed_message(
    start: Start, transport: str
) -> None:
    """One attempt only, so a failed one would be a dead letter at once: the consumer's commit
    (inbox row and effect) stands, its after-commit dispatch outlasts the handler's limit, and the
    message is acknowledged: one inbox row, both effects, no dead letter, no second run."""
    container, observer = await start(
        transport,
        message_bus={"handler_timeout_seconds": LIMIT, "max_delivery_attempts": 1},
        observer=RaisesASlowEvent(),
    )
    runs = slow_domain_handler(container)
    await container.bus().publish(envelope(1))
    await effects_become(container, ["consumed:1", "noted:after:1"], timeout=30)
    await asyncio.sleep(2.0)  # past the redelivery delay: a failed attempt would show by now
    assert await container.bus().dead_letters(CONSUMER) == []
    assert len(await inbox_rows(container)) == 1
    assert len(observer.seen) == 1
    assert runs == ["after:1"]
    assert await effects_of(container) == ["consumed:1", "noted:after:1"]
    registry = container.metrics().registry
    assert registry.get_sample_value("inbox_failures_total", {"consumer": CONSUMER}) in {None, 0.0}
    assert registry.get_sample_value("inbox_consumed_total", {"consumer": CONSUMER}) == 1.0


async def test_a_slow_after_commit_dispatch_never_fails_an_in_process_consumer(
    make_container: ContainerFactory,
) -> None:
    """The in-process transport: the integration event's outbox row is stamped on its first
    delivery, never charged a retry for a consumer whose commit stood."""
    container = make_container(
        outbox={"delivery_timeout_seconds": 10, "lease_seconds": 30, "processing_delay_seconds": 0},
        message_bus={"handler_timeout_seconds": LIMIT},
    )
    await install_kit(container)
    observer = RaisesASlowEvent()
    container.handlers().consume(CONSUMER, CounterChangedV1, observer)
    slow_domain_handler(container)
    await container.worker().start()
    try:
        with acting_as():
            async with container.units_of_work()() as uow:
                uow.enqueue(CounterChangedV1(counter_id="c-1", value=1))
                await uow.commit()

        async def stamped() -> Any:
            rows = await fetch(container, sa.select(OUTBOX_TABLE).where(OUTBOX_TABLE.c.kind == "integration"))
            return rows[0] if rows and rows[0].processed_on is not None else None

        deadline = asyncio.get_running_loop().time() + 30
        while (row := await stamped()) is None:
            assert asyncio.get_running_loop().time() < deadline, "the integration row was never stamped"
            await asyncio.sleep(0.1)
        assert (row.retry_count, row.last_error) == (0, None)
        await eventually(lambda: len(observer.seen) == 1)
        assert len(await inbox_rows(container)) == 1
        assert len(observer.seen) == 1
    finally:
        await asyncio.wait_for(container.worker().stop(), 30)
