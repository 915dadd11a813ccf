"""The runtime guard: a handler that commits while the unit of work dispatches to it is refused.

The static rule (``outbox_kit.testing.rules``) proves it before the code runs; this proves the
unit of work refuses it when it does run, on each dispatch path: a domain event delivered after
commit, an internal command run by its processor, an integration event through the consume
pipeline; and below the ORM, a Core transaction on the service's engine. A real database (SQLite
and PostgreSQL); a test-only aggregate, events and handlers registered on the container.

What is observable: the dispatcher does not let the error escape the commit that raised the event
(the business write stands); it logs it and releases the outbox row's lease with ``last_error``
naming the error and the handler, so the processor retries it. The processors record it on the
row as a failed attempt. The handlers below also keep the exception they saw.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import pytest
import sqlalchemy as sa
from outbox_kit.application.handlers import handler_name
from outbox_kit.application.messages import (
    IntegrationEvent,
    InternalCommand,
)
from outbox_kit.domain import (
    AggregateRoot,
    DomainEvent,
    Message,
    applies,
)
from outbox_kit.persistence.repository import (
    Repository,
)
from outbox_kit.persistence.save_guard import HandlerMustNotSaveError
from outbox_kit.persistence.tables import (
    COMMAND_TABLE,
    OUTBOX_TABLE,
    InboxMessage,
)
from outbox_kit.persistence.unit_of_work import SqlUnitOfWork, SqlUnitOfWorkFactory
from outbox_kit.runtime.container import OutboxContainer
from outbox_kit.testing.fixtures import ContainerFactory

pytestmark = pytest.mark.unit


@pytest.fixture
async def service_container(make_container: ContainerFactory) -> OutboxContainer:
    """The kit's container on a fresh database: outbox and inbox on, no processing delay."""
    return make_container(outbox={"processing_delay_seconds": 0})


@dataclass(frozen=True, kw_only=True)
class ProbeRaised(DomainEvent, name="architecture-tests.probe-raised.v1"):
    note: str = ""


class ProbeAnnounced(IntegrationEvent, name="architecture-tests.probe-announced.v1"):
    note: str = ""


class ProbeCommand(InternalCommand, name="architecture-tests.probe-command.v1"):
    note: str = ""


class Probe(AggregateRoot):
    """The smallest aggregate: starting it raises ``ProbeRaised``."""

    note: str = ""

    @classmethod
    def start(cls) -> Probe:
        probe = cls(uuid.uuid4().hex)
        probe._raise(ProbeRaised(aggregate_id=probe.id, note="started"))
        return probe

    @applies(ProbeRaised)
    def _raised(self, event: ProbeRaised) -> None:
        self.note = event.note


class Probes(Repository[Probe]):
    """Stores nothing: enough for the unit of work to capture the probe's events."""

    async def _load(self, _aggregate_id: str) -> Probe | None:
        return None

    async def persist(self, aggregate: Probe) -> int:
        return aggregate.version + 1


class CommitsItsUnitOfWork:
    """Misbehaves: commits the unit of work that dispatches it."""

    def __init__(self) -> None:
        self.errors: list[Exception] = []

    async def __call__(self, _message: Message, uow: SqlUnitOfWork) -> None:
        try:
            await uow.commit()
        except Exception as error:
            self.errors.append(error)
            raise


class OpensASecondUnitOfWork:
    """Misbehaves: opens a unit of work of its own, enqueues an event and commits it."""

    def __init__(self, units: SqlUnitOfWorkFactory) -> None:
        self.units = units
        self.errors: list[Exception] = []

    async def __call__(self, message: Message, _uow: SqlUnitOfWork) -> None:
        try:
            async with self.units() as other:
                other.enqueue(ProbeAnnounced(note=f"side effect of {type(message).__name__}"))
                await other.commit()
        except Exception as error:
            self.errors.append(error)
            raise


class WritesThroughTheEngine:
    """Misbehaves below the ORM: a Core transaction of its own on the service's engine."""

    def __init__(self, container: OutboxContainer) -> None:
        self.container = container
        self.errors: list[Exception] = []

    async def __call__(self, message: Message, _uow: SqlUnitOfWork) -> None:
        try:
            async with self.container.database().engine.begin() as connection:
                await connection.execute(
                    OUTBOX_TABLE.update().values(last_error=f"written by {type(message).__name__}")
                )
        except Exception as error:
            self.errors.append(error)
            raise


class OnlyEnqueues:
    """Behaves: mutates nothing itself, enqueues an integration event."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, message: Message, uow: SqlUnitOfWork) -> None:
        self.calls += 1
        uow.enqueue(ProbeAnnounced(note=type(message).__name__))


async def start_probe(container: OutboxContainer) -> None:
    async with container.units_of_work()() as uow:
        uow.repository(Probes).add(Probe.start())
        await uow.commit()


async def rows(container: OutboxContainer, table: sa.Table, **where: Any) -> list[Any]:
    statement = sa.select(table).where(*(table.c[name] == value for name, value in where.items()))
    async with container.database().session() as session:
        return list((await session.exec(statement)).all())  # type: ignore[call-overload]


async def run_source(container: OutboxContainer, name: str) -> None:
    (source,) = [source for source in container.sources() if source.name == name]
    await source.run_cycle()


def assert_refused(errors: list[Exception], handler: object) -> None:
    (error,) = errors
    assert isinstance(error, HandlerMustNotSaveError)
    assert handler_name(handler) in str(error)


async def test_a_domain_event_handler_that_commits_is_refused_and_the_event_released(
    service_container: OutboxContainer,
) -> None:
    handler = CommitsItsUnitOfWork()
    service_container.handlers().on_domain_event(ProbeRaised, handler)

    await start_probe(service_container)  # the commit that raised the event stands

    assert_refused(handler.errors, handler)
    (row,) = await rows(service_container, OUTBOX_TABLE, event_name=ProbeRaised.message_name)
    assert row.processed_on is None
    assert row.lock_token is None
    assert row.locked_until is None
    assert "HandlerMustNotSaveError" in row.last_error
    assert handler_name(handler) in row.last_error


async def test_a_handler_that_commits_a_second_unit_of_work_is_refused(
    service_container: OutboxContainer,
) -> None:
    handler = OpensASecondUnitOfWork(service_container.units_of_work())
    service_container.handlers().on_domain_event(ProbeRaised, handler)

    await start_probe(service_container)

    assert_refused(handler.errors, handler)
    (row,) = await rows(service_container, OUTBOX_TABLE, event_name=ProbeRaised.message_name)
    assert row.processed_on is None
    assert handler_name(handler) in row.last_error
    assert await rows(service_container, OUTBOX_TABLE, event_name=ProbeAnnounced.message_name) == []


async def test_an_internal_command_handler_that_commits_is_refused_and_retried(
    service_container: OutboxContainer,
) -> None:
    handler = CommitsItsUnitOfWork()
    service_container.registry().register(ProbeCommand)
    service_container.handlers().on_command(ProbeCommand, handler)
    async with service_container.units_of_work()() as uow:
        uow.schedule(ProbeCommand(note="later"))
        await uow.commit()

    await run_source(service_container, "internal_commands")

    assert_refused(handler.errors, handler)
    (row,) = await rows(service_container, COMMAND_TABLE, command_name=ProbeCommand.message_name)
    assert row.processed_on is None
    assert row.retry_count == 1
    assert row.last_error.startswith("HandlerMustNotSaveError: ")
    assert handler_name(handler) in row.last_error


async def test_a_consumer_that_commits_is_refused_and_nothing_is_consumed(
    service_container: OutboxContainer,
) -> None:
    handler = CommitsItsUnitOfWork()
    service_container.registry().register(ProbeAnnounced)
    service_container.handlers().consume("architecture-tests.probe-consumer", ProbeAnnounced, handler)
    async with service_container.units_of_work()() as uow:
        uow.enqueue(ProbeAnnounced(note="published"))
        await uow.commit()

    await run_source(service_container, "outbox")

    assert_refused(handler.errors, handler)
    (row,) = await rows(service_container, OUTBOX_TABLE, event_name=ProbeAnnounced.message_name)
    assert row.processed_on is None
    assert row.retry_count == 1
    assert "HandlerMustNotSaveError" in row.last_error
    assert handler_name(handler) in row.last_error
    inbox = InboxMessage.__table__  # type: ignore[attr-defined]
    assert await rows(service_container, inbox, consumer="architecture-tests.probe-consumer") == []


async def test_a_handler_that_commits_a_core_transaction_is_refused_and_writes_nothing(
    service_container: OutboxContainer,
) -> None:
    handler = WritesThroughTheEngine(service_container)
    service_container.handlers().on_domain_event(ProbeRaised, handler)

    await start_probe(service_container)

    assert_refused(handler.errors, handler)
    (row,) = await rows(service_container, OUTBOX_TABLE, event_name=ProbeRaised.message_name)
    assert row.processed_on is None
    assert "written by" not in (row.last_error or "")  # the refused COMMIT never reached the table
    assert handler_name(handler) in row.last_error


async def test_a_handler_that_does_not_commit_is_delivered(service_container: OutboxContainer) -> None:
    handler = OnlyEnqueues()
    service_container.handlers().on_domain_event(ProbeRaised, handler)

    await start_probe(service_container)

    assert handler.calls == 1
    (row,) = await rows(service_container, OUTBOX_TABLE, event_name=ProbeRaised.message_name)
    assert row.processed_on is not None
    assert row.last_error is None
    (announced,) = await rows(service_container, OUTBOX_TABLE, event_name=ProbeAnnounced.message_name)
    assert announced.processed_on is None  # waits for the processor, as integration events do
