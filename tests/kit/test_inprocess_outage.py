"""The in-process bus: a database outage inside one of its consumers is not the row's fault, so
the outbox row that carried the event is released uncharged, as for a local domain event."""

from __future__ import annotations

import pytest
from outbox_kit.persistence.unit_of_work import SqlUnitOfWork
from outbox_kit.runtime.container import OutboxContainer
from outbox_kit.testing.harness import (
    CounterChangedV1,
    FakeClock,
    insert_rows,
    install_kit,
    outbox_source,
    row,
    state,
)
from sqlalchemy.exc import DBAPIError

pytestmark = pytest.mark.integration
PAYLOAD = {"counter_id": "c-1", "value": 1}


async def database_drops(event: CounterChangedV1, uow: SqlUnitOfWork) -> None:
    del event, uow
    raise DBAPIError(
        "COMMIT", {}, ConnectionResetError("server closed the connection"), connection_invalidated=True
    )


async def fails_on_its_own(event: CounterChangedV1, uow: SqlUnitOfWork) -> None:
    del event, uow
    msg = "a genuine consumer failure"
    raise RuntimeError(msg)


@pytest.mark.parametrize(
    "consumers",
    [[database_drops], [fails_on_its_own, database_drops]],
    ids=["one consumer", "a failure before the outage"],
)
async def test_a_database_outage_in_an_in_process_consumer_charges_no_retry(
    container: OutboxContainer, consumers: list[object]
) -> None:
    await install_kit(container)
    for number, consumer in enumerate(consumers):
        container.handlers().consume(f"kit.consumer-{number}", CounterChangedV1, consumer)  # type: ignore[arg-type]
    clock = FakeClock()
    (row_id,) = await insert_rows(container, [row(CounterChangedV1.message_name, clock.now, payload=PAYLOAD)])
    await outbox_source(container, container.outbox_deliverer(), clock).run_cycle()
    released = await state(container, row_id)
    assert (released.retry_count, released.lock_token, released.locked_until) == (0, None, None)
    assert released.last_error.startswith("paused, not charged: database unreachable: ConsumerFailedError")


async def test_a_genuine_in_process_consumer_failure_is_still_charged(container: OutboxContainer) -> None:
    await install_kit(container)
    container.handlers().consume("kit.consumer", CounterChangedV1, fails_on_its_own)
    clock = FakeClock()
    (row_id,) = await insert_rows(container, [row(CounterChangedV1.message_name, clock.now, payload=PAYLOAD)])
    await outbox_source(container, container.outbox_deliverer(), clock).run_cycle()
    failed = await state(container, row_id)
    assert failed.retry_count == 1
    assert "RuntimeError: a genuine consumer failure" in failed.last_error
