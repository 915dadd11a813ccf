"""An integration event published before its first consumer exists (issue 34, item 15), on every
transport: the publish is a delivery to nobody, never a failure. The row is stamped processed
(never retried, never dead-lettered), the next event of its ordering key goes out, the publish is
counted in ``outbox_unrouted_total`` with one Warning per event name, ``explain`` says so, and a
consumer that binds afterwards gets what is published from then on.

Kafka cannot tell cheaply whether any consumer group reads a topic, so there the row is only
processed (the record stays in the topic for the group that subscribes first): no note, no count."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from outbox_kit.persistence.tables import OutboxMessage
from outbox_kit.persistence.unit_of_work import SqlUnitOfWork
from outbox_kit.runtime.container import OutboxContainer
from outbox_kit.testing.fixtures import (
    SERVICE_URLS,
    acting_as,
    fetch,
    fresh_sqlite,
    kit_container,
    make_settings,
)
from outbox_kit.testing.harness import CONSUMER, CounterChangedV1, effects, install_kit, record_effect

pytestmark = pytest.mark.integration

EVENT = "kit.counter-changed.v1"
TRANSPORTS = [
    "inprocess",
    pytest.param("rabbitmq", marks=pytest.mark.rabbitmq),
    pytest.param("kafka", marks=pytest.mark.kafka),
    pytest.param("nats", marks=pytest.mark.nats),
    pytest.param("redis", marks=pytest.mark.redis),
]

Start = Callable[..., Awaitable[OutboxContainer]]


async def consume(event: CounterChangedV1, uow: SqlUnitOfWork) -> None:
    await record_effect(uow, f"consumed:{event.value}")


@pytest.fixture
async def start(tmp_path: Path, sqlite_template: Path) -> AsyncIterator[Start]:
    """Start a service (its own SQLite database) on ``transport`` in ``namespace``, consuming the
    kit's event or not."""
    running: list[OutboxContainer] = []

    async def starter(transport: str, namespace: str, *, consumer: bool) -> OutboxContainer:
        home = tmp_path / f"service-{len(running)}"
        home.mkdir()
        bus: dict[str, Any] = {"transport": transport}
        if transport != "inprocess":
            bus |= {"url": SERVICE_URLS[transport], "enable_outbox": True, "enable_inbox": True}
        settings = make_settings(
            fresh_sqlite(home, sqlite_template),
            application={"namespace": namespace},
            message_bus=bus,
            outbox={"polling_interval_seconds": 0.2},
        )
        container = kit_container(settings)
        await install_kit(container)
        if consumer:
            container.handlers().consume(CONSUMER, CounterChangedV1, consume)
        await container.bus().start()
        await container.worker().start()
        running.append(container)
        return container

    yield starter
    for container in reversed(running):
        await container.worker().stop()
        if hasattr(container.bus(), "delete_topology"):
            await container.bus().delete_topology()
        await container.database().dispose()


async def publish(container: OutboxContainer, value: int) -> None:
    with acting_as():
        async with container.units_of_work()() as uow:
            uow.enqueue(CounterChangedV1(counter_id="c-1", value=value, aggregate_id="c-1"))
            await uow.commit()


async def rows_when_settled(container: OutboxContainer, count: int, timeout: float = 30.0) -> list[Any]:
    """The outbox rows once ``count`` of them are processed or dead-lettered, oldest first."""
    deadline = time.monotonic() + timeout
    while True:
        table = OutboxMessage.__table__
        rows = await fetch(container, sa.select(table).order_by(table.c.seq))  # type: ignore[attr-defined]
        finished = [r for r in rows if r.processed_on is not None or r.dead_lettered_on is not None]
        if len(finished) >= count:
            return rows
        if time.monotonic() > deadline:
            raise AssertionError(f"rows did not settle: {rows}")
        await asyncio.sleep(0.1)


async def effects_include(container: OutboxContainer, wanted: str, timeout: float = 30.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        async with container.database().session() as session:
            found = await effects(session)
        if wanted in found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"effects are {found}, {wanted} never came")
        await asyncio.sleep(0.1)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_an_event_with_no_consumer_is_delivered_to_nobody_not_dead_lettered(
    start: Start, transport: str, caplog: pytest.LogCaptureFixture
) -> None:
    namespace = f"t{uuid.uuid4().hex[:10]}"
    caplog.set_level(logging.WARNING, logger="outbox_kit")
    publisher = await start(transport, namespace, consumer=False)
    await publish(publisher, 1)
    await publish(publisher, 2)  # the same ordering key: must not wait behind the first

    first, second = await rows_when_settled(publisher, 2)
    for row in (first, second):
        assert row.dead_lettered_on is None, row.last_error
        assert row.processed_on is not None
        assert row.retry_count == 0
    if transport == "kafka":
        assert first.last_error is None
    else:
        await the_publishes_are_reported_unrouted(publisher, first, second, caplog)

    # A consumer binds (on a broker: another service of the namespace; in-process: this one).
    if transport == "inprocess":
        publisher.handlers().consume(CONSUMER, CounterChangedV1, consume)
        consumer = publisher
    else:
        consumer = await start(transport, namespace, consumer=True)
    await publish(publisher, 3)
    await effects_include(consumer, "consumed:3")
    third = (await rows_when_settled(publisher, 3))[2]
    assert third.processed_on is not None
    assert not (third.last_error or "").startswith("unrouted: ")
    assert (await publisher.admin().explain("outbox", str(third.id))).state == "processed"


async def the_publishes_are_reported_unrouted(
    publisher: OutboxContainer, first: Any, second: Any, caplog: pytest.LogCaptureFixture
) -> None:
    for row in (first, second):
        assert (row.last_error or "").startswith("unrouted: "), row.last_error
    counted = publisher.metrics().registry.get_sample_value(
        "outbox_unrouted_total", {"source": "outbox", "event_name": EVENT}
    )
    assert counted == 2.0
    warnings = [r for r in caplog.records if "unrouted" in r.getMessage() and EVENT in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert warnings[0].levelno == logging.WARNING
    explained = await publisher.admin().explain("outbox", str(first.id))
    assert explained.state == "unrouted"
    assert "published with no subscriber bound (unrouted)" in explained.detail


async def test_a_look_up_that_fails_after_an_accepted_publish_never_fails_it() -> None:
    """Redis and NATS ask whether anyone reads a destination after the broker accepted the
    publish: a look-up that fails says "routed" (the publish stands; failing it would publish
    the row again), one that finds nobody says Unrouted."""
    from outbox_kit.transports.base import KnownConsumers

    async def broken() -> bool:
        raise ConnectionError("the look-up lost its connection")

    async def nobody() -> bool:
        return False

    known = KnownConsumers()
    assert await known.unrouted("stream", broken, "nobody reads it") is None
    assert await known.unrouted("stream", nobody, "nobody reads it") is not None
