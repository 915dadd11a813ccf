"""The relay publishes a claimed batch together: every publish of the batch is in flight at once
(up to the delivery concurrency), the confirmed rows are stamped in one statement, and a row
that fails fails alone. Against real brokers; statements and concurrency are asserted, never
timing (that is ``make bench``)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import sqlalchemy as sa
from outbox_kit.persistence.tables import OUTBOX_TABLE
from outbox_kit.runtime.container import OutboxContainer
from outbox_kit.testing.fixtures import SERVICE_URLS, ContainerFactory, acting_as
from outbox_kit.testing.harness import CounterChangedV1, all_rows, install_kit, outbox_source

ROWS = 12


async def ignore(event: CounterChangedV1, uow: object) -> None:
    del event, uow


class InFlight:
    """Counts the publishes awaiting their broker's acknowledgement at once."""

    def __init__(self) -> None:
        self.now = 0
        self.most = 0
        self.calls = 0

    def wrap(self, publish: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            self.now += 1
            self.most = max(self.most, self.now)
            try:
                return await publish(*args, **kwargs)
            finally:
                self.now -= 1

        return counted


Started = tuple[OutboxContainer, InFlight, list[str]]


@pytest.fixture
def publish_timeout() -> float:
    return 10.0


@pytest.fixture
async def started(
    make_container: ContainerFactory, transport: str, publish_timeout: float
) -> AsyncIterator[Started]:
    """A container on ``transport`` with a consumer bound (so publishes are routed), its bus
    started but not consuming, ``ROWS`` integration events committed, and the broker client's
    publish wrapped by an :class:`InFlight`; the UPDATE statements that stamp rows are recorded."""
    container = make_container(
        application={"namespace": f"batch{uuid.uuid4().hex[:8]}"},
        message_bus={
            "transport": transport,
            "url": SERVICE_URLS[transport],
            "publish_timeout_seconds": publish_timeout,
        },
        outbox={"delivery_concurrency": 8, "batch_size": 50},
    )
    await install_kit(container)
    container.handlers().consume("kit.batch-consumer", CounterChangedV1, ignore)
    with acting_as():
        async with container.units_of_work()() as uow:
            for value in range(ROWS):
                uow.enqueue(CounterChangedV1(counter_id=f"c-{value}", value=value))
            await uow.commit()
    bus = container.bus()
    await bus.start()
    flight = InFlight()
    transport_: Any = bus
    if transport == "rabbitmq":
        exchange = await transport_._resolve_exchange()
        channel = await exchange.channel.get_underlay_channel()
        channel.basic_publish = flight.wrap(channel.basic_publish)
    else:
        transport_.send = flight.wrap(transport_.send)
    stamps: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if (
            statement.lstrip().upper().startswith("UPDATE")
            and "processed_on" in statement.split("WHERE", maxsplit=1)[0]
        ):
            stamps.append(statement)

    engine = container.database().bookkeeping_engine.sync_engine
    sa.event.listen(engine, "before_cursor_execute", record)
    try:
        yield container, flight, stamps
    finally:
        sa.event.remove(engine, "before_cursor_execute", record)
        await bus.delete_topology()  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "transport",
    [pytest.param("rabbitmq", marks=pytest.mark.rabbitmq), pytest.param("redis", marks=pytest.mark.redis)],
)
async def test_a_batch_is_published_together_and_stamped_in_one_statement(started: Started) -> None:
    container, flight, stamps = started
    source = outbox_source(container, container.outbox_deliverer())
    result = await source.run_cycle()
    assert (result.claimed, result.completed) == (ROWS, ROWS)
    assert flight.calls == ROWS
    # All in flight together, up to the delivery concurrency (SQLite's single writer: 1).
    assert flight.most == (8 if container.database().is_postgresql else 1)
    assert len(stamps) == 1  # one stamp for the whole batch
    rows = await all_rows(container)
    assert all(r.processed_on is not None and r.lock_token is None for r in rows)


@pytest.mark.parametrize("transport", [pytest.param("redis", marks=pytest.mark.redis)])
async def test_a_row_that_cannot_be_read_fails_alone_and_its_batch_mates_are_delivered(
    started: Started,
) -> None:
    """A row whose payload no longer fits its class is charged a retry; the rest of its batch is
    published and stamped as usual."""
    container, flight, _ = started
    rows = await all_rows(container)
    broken = rows[3].id
    async with container.database().session() as session:
        await session.exec(  # type: ignore[call-overload]
            OUTBOX_TABLE.update().where(OUTBOX_TABLE.c.id == broken).values(payload={"counter_id": "c-3"})
        )
        await session.commit()
    source = outbox_source(container, container.outbox_deliverer())
    result = await source.run_cycle()
    assert (result.claimed, result.completed) == (ROWS, ROWS - 1)
    assert flight.calls == ROWS - 1  # the broken row is never published
    after = {r.id: r for r in await all_rows(container)}
    assert after[broken].processed_on is None
    assert after[broken].retry_count == 1
    assert after[broken].last_error.startswith("MalformedPayloadError")
    assert all(r.processed_on is not None for row_id, r in after.items() if row_id != broken)


@pytest.mark.parametrize("transport", [pytest.param("redis", marks=pytest.mark.redis)])
async def test_a_batch_whose_delivery_raises_is_charged_row_by_row(started: Started) -> None:
    """The deliverer answers per row; if it raises all the same (a bug, an injected fault), every
    row of the batch is charged a retry under its own token, nothing is left leased."""
    container, _, _ = started
    deliverer = container.outbox_deliverer()

    async def broken(*_: Any) -> list[Any]:
        msg = "the deliverer itself failed"
        raise RuntimeError(msg)

    deliverer.deliver_published = broken  # type: ignore[method-assign]
    result = await outbox_source(container, deliverer).run_cycle()
    assert (result.claimed, result.completed) == (ROWS, 0)
    rows = await all_rows(container)
    assert [(r.retry_count, r.lock_token, r.processed_on) for r in rows] == [(1, None, None)] * ROWS
    assert all("the deliverer itself failed" in r.last_error for r in rows)


@pytest.mark.parametrize("publish_timeout", [0.5])
@pytest.mark.parametrize("transport", [pytest.param("rabbitmq", marks=pytest.mark.rabbitmq)])
async def test_a_batch_whose_channel_does_not_come_back_is_paused_not_charged(started: Started) -> None:
    """aio-pika's robust channel waits for a lost connection to come back: that wait is bounded
    by the publish timeout and is an outage of the batch (released, no retry charged), never the
    delivery's time limit (which charges every row)."""
    container, flight, _ = started
    exchange = await container.bus()._resolve_exchange()  # type: ignore[attr-defined]

    async def never() -> None:
        await asyncio.Event().wait()

    exchange.channel.get_underlay_channel = never
    try:
        result = await outbox_source(container, container.outbox_deliverer()).run_cycle()
    finally:
        del exchange.channel.get_underlay_channel  # the channel's own again (teardown uses it)
    assert (result.claimed, result.completed, flight.calls) == (ROWS, 0, 0)
    rows = await all_rows(container)
    assert [(r.retry_count, r.lock_token, r.processed_on) for r in rows] == [(0, None, None)] * ROWS
    assert all(r.last_error.startswith("paused, not charged") for r in rows)
