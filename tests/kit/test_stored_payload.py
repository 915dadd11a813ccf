"""A published message carries its row's stored payload, so every copy of one row is
byte-identical: across a deploy that changed the event's class compatibly (an optional field
added), a redelivered row is a duplicate to the consumer's inbox, not a conflict (issue 34)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import pytest
import sqlalchemy as sa
from outbox_kit.persistence.tables import OUTBOX_TABLE
from outbox_kit.persistence.unit_of_work import SqlUnitOfWork
from outbox_kit.runtime.container import OutboxContainer
from outbox_kit.testing.fixtures import SERVICE_URLS, eventually, kit_container, make_settings
from outbox_kit.testing.harness import CONSUMER, CounterChangedV1, install_kit
from outbox_kit.transports.bus import PublishResult
from outbox_kit.transports.envelope import Envelope

pytestmark = pytest.mark.integration
TRANSPORTS = [
    "inprocess",
    pytest.param("rabbitmq", marks=pytest.mark.rabbitmq),
    pytest.param("kafka", marks=pytest.mark.kafka),
    pytest.param("nats", marks=pytest.mark.nats),
    pytest.param("redis", marks=pytest.mark.redis),
]


class CounterChangedNextRelease(CounterChangedV1, name="kit.counter-changed.v1"):
    """The next release of the same event: one optional field added (compatible)."""

    note: str | None = None


def deploy(container: OutboxContainer, cls: type[CounterChangedV1]) -> None:
    """The new release's class now answers the event's name and its consumer takes it: what a
    restart on the new release does (no API swaps a registered class in a running process)."""
    container.registry()._classes[cls.message_name] = cls
    consumers = container.handlers()._consumers
    consumers[CONSUMER] = dataclasses.replace(consumers[CONSUMER], event_type=cls)


Start = Callable[[str], Awaitable[tuple[OutboxContainer, list[bytes], list[int]]]]


@pytest.fixture
async def start(database_url: str) -> AsyncIterator[Start]:
    running: list[OutboxContainer] = []

    async def starter(transport: str) -> tuple[OutboxContainer, list[bytes], list[int]]:
        settings = make_settings(
            database_url,
            application={"namespace": f"t{uuid.uuid4().hex[:10]}"},
            message_bus={
                "transport": transport,
                "url": SERVICE_URLS.get(transport, ""),
                "enable_inbox": True,
                "max_delivery_attempts": 3,
                "redelivery_delay_seconds": 0.3,
            },
            outbox={"polling_interval_seconds": 0.2},
        )
        container = kit_container(settings)
        await install_kit(container)
        handled: list[int] = []

        async def handler(event: CounterChangedV1, uow: SqlUnitOfWork) -> None:
            del uow
            handled.append(event.value)

        container.handlers().consume(CONSUMER, CounterChangedV1, handler)
        bus = container.bus()
        published: list[bytes] = []
        publish_batch = bus.publish_batch

        async def recording(envelopes: Sequence[Envelope], window: int) -> list[PublishResult]:
            published.extend(envelope.body for envelope in envelopes)
            return await publish_batch(envelopes, window)

        bus.publish_batch = recording  # type: ignore[method-assign]
        await bus.start()
        await container.worker().start()
        running.append(container)
        return container, published, handled

    yield starter
    for container in running:
        await container.worker().stop()
        delete = getattr(container.bus(), "delete_topology", None)
        if delete is not None:
            await delete()
        await container.database().dispose()


def sample(container: OutboxContainer, name: str, labels: dict[str, str]) -> float | None:
    return container.metrics().registry.get_sample_value(name, labels)  # type: ignore[no-any-return]


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_row_redelivered_after_a_compatible_deploy_is_a_duplicate_not_a_conflict(
    start: Start, transport: str
) -> None:
    """Publish a row; deploy a release whose class adds an optional field; the row is published
    again (its processed stamp lost: a crash between the broker's confirm and the stamp, or a
    lease that ran out). Both copies carry the same bytes, so the consumer's inbox acknowledges
    and skips the second one, where re-encoding the payload through the new class made it
    ``conflicting_duplicate``."""
    container, published, handled = await start(transport)
    async with container.units_of_work()() as uow:
        uow.enqueue(CounterChangedV1(counter_id="c-1", value=7, aggregate_id="c-1"))
        await uow.commit()
    await eventually(lambda: handled == [7], timeout=30)
    await wait_processed(container)

    deploy(container, CounterChangedNextRelease)
    async with container.database().session() as session:  # the stamp that never got written
        await session.exec(OUTBOX_TABLE.update().values(processed_on=None))  # type: ignore[call-overload]
        await session.commit()

    await eventually(lambda: len(published) == 2, timeout=30)
    await wait_processed(container)
    if transport != "nats":  # JetStream itself drops a copy within its dedup window (Nats-Msg-Id)
        duplicates = {"consumer": CONSUMER}
        await eventually(lambda: sample(container, "inbox_duplicates_total", duplicates) == 1.0, timeout=30)
    assert published[0] == published[1], published
    assert handled == [7]
    conflicts = {"consumer": CONSUMER, "reason": "conflicting_duplicate"}
    assert sample(container, "inbox_dead_letters_total", conflicts) in (None, 0.0)


async def wait_processed(container: OutboxContainer, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    query = sa.select(sa.func.count()).where(OUTBOX_TABLE.c.processed_on.is_(None))
    while True:
        async with container.database().session() as session:
            left = (await session.exec(query)).scalar_one()  # type: ignore[call-overload]
        if left == 0:
            return
        assert time.monotonic() < deadline, f"{left} rows still pending"
        await asyncio.sleep(0.1)
