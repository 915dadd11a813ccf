"""A tiny bounded context used only by the tests, so the kit is proven whether or
not the example contexts were generated: a ``Counter`` aggregate with its own table (created by
the fixture, outside the migrations), events, an integration event and an internal command."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import sqlalchemy as sa
from outbox_kit.application.context import (
    current_context,
)
from outbox_kit.application.messages import (
    IntegrationEvent,
    InternalCommand,
)
from outbox_kit.domain import (
    AggregateRoot,
    DomainEvent,
    applies,
)
from outbox_kit.persistence.repository import (
    Repository,
)
from outbox_kit.persistence.unit_of_work import (
    SqlUnitOfWork,
)
from sqlmodel.ext.asyncio.session import AsyncSession

from {{ cookiecutter.package_name }}.container import (
    Container,
)

metadata = sa.MetaData()
COUNTERS = sa.Table(
    "kit_counters",
    metadata,
    sa.Column("id", sa.String(200), primary_key=True),  # ids up to the longest ordering key
    sa.Column("tenant_id", sa.String(64), nullable=False),
    sa.Column("value", sa.Integer, nullable=False),
    sa.Column("version", sa.Integer, nullable=False),
)
DELIVERIES = sa.Table(
    "kit_deliveries",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("row_id", sa.String(64), nullable=False),
    sa.Column("seq", sa.BigInteger, nullable=False),
    sa.Column("ordering_key", sa.String(200)),
    sa.Column("processor", sa.String(64), nullable=False),
    sa.Column("token", sa.String(64), nullable=False),
    sa.Column("delivered_at", sa.Float, nullable=False),
)
EFFECTS = sa.Table(
    "kit_effects",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("label", sa.String(200), nullable=False),
    sa.Column("tenant_id", sa.String(64)),
)
RECEIVED = sa.Table(  # what a consumer of the reliability scenarios saw, one row per handler run
    "kit_received",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("label", sa.String(200), nullable=False),  # not unique: a duplicate must show
    sa.Column("ordering_key", sa.String(200)),
    sa.Column("value", sa.BigInteger, nullable=False),
    sa.Column("tenant_id", sa.String(64)),
    sa.Column("user_id", sa.String(64)),
    sa.Column("roles", sa.String(200)),
    sa.Column("correlation_id", sa.String(64)),
    sa.Column("worker", sa.String(64), nullable=False),
    sa.Column("received_at", sa.Float, nullable=False),
)


@dataclass(frozen=True, kw_only=True)
class Created(DomainEvent, name="kit.created.v1", ordered=True):
    tenant_id: str


@dataclass(frozen=True, kw_only=True)
class Incremented(DomainEvent, name="kit.incremented.v1", ordered=True):
    by: int


@dataclass(frozen=True, kw_only=True)
class Noted(DomainEvent, name="kit.noted.v1"):
    text: str


class CounterChangedV1(IntegrationEvent, name="kit.counter-changed.v1", ordered=True):
    counter_id: str
    value: int


class RecordEffect(InternalCommand, name="kit.record-effect.v1"):
    label: str


class Counter(AggregateRoot):
    def __init__(self, counter_id: str, *, version: int = 0) -> None:
        super().__init__(counter_id, version=version)
        self.tenant_id = ""
        self.value = 0
        self.notes: list[str] = []

    @classmethod
    def create(cls, tenant_id: str, counter_id: str | None = None) -> Counter:
        counter = cls(counter_id or uuid.uuid4().hex)
        counter._raise(Created(aggregate_id=counter.id, tenant_id=tenant_id))
        return counter

    def increment(self, by: int = 1) -> None:
        self._raise(Incremented(aggregate_id=self.id, by=by))

    def note(self, text: str) -> None:
        self._raise(Noted(aggregate_id=self.id, text=text))

    @applies(Created)
    def _created(self, event: Created) -> None:
        self.tenant_id = event.tenant_id

    @applies(Incremented)
    def _incremented(self, event: Incremented) -> None:
        self.value += event.by

    @applies(Noted)
    def _noted(self, event: Noted) -> None:
        self.notes.append(event.text)


class Counters(Protocol):
    def add(self, counter: Counter) -> None: ...

    async def get(self, counter_id: str) -> Counter: ...


class SqlCounters(Repository[Counter]):
    aggregate_name = "counter"

    async def _load(self, aggregate_id: str) -> Counter | None:
        row = (
            await self.session.exec(  # type: ignore[call-overload]
                sa.select(COUNTERS).where(
                    COUNTERS.c.id == aggregate_id, COUNTERS.c.tenant_id == self.tenant_id
                )
            )
        ).first()
        if row is None:
            return None
        counter = Counter(row.id, version=row.version)
        counter.tenant_id, counter.value = row.tenant_id, row.value
        return counter

    async def persist(self, aggregate: Counter) -> int:
        if aggregate.version == 0:
            await self.session.exec(  # type: ignore[call-overload]
                sa.insert(COUNTERS).values(
                    id=aggregate.id, tenant_id=aggregate.tenant_id, value=aggregate.value, version=1
                )
            )
            return 1
        return await self._versioned_update(COUNTERS, aggregate, {"value": aggregate.value})


async def record_effect(uow: SqlUnitOfWork, label: str) -> None:
    """What a handler's state change looks like here: a row in the handler's transaction."""
    await uow.session.exec(  # type: ignore[call-overload]
        sa.insert(EFFECTS).values(label=label, tenant_id=current_context().tenant_id)
    )


async def effects(session: AsyncSession) -> list[str]:
    rows = await session.exec(sa.select(EFFECTS.c.label).order_by(EFFECTS.c.id))  # type: ignore[call-overload]
    return [row[0] for row in rows]


Handler = Callable[[Any, SqlUnitOfWork], Awaitable[None]]


@dataclass
class Kit:
    """The test context installed on one container."""

    container: Container
    seen: list[tuple[str, Any]] = field(default_factory=list)

    def on(self, event_type: type[Any], handler: Handler) -> None:
        self.container.handlers().on_domain_event(event_type, handler)

    def recording(self, label: str) -> Handler:
        async def handler(event: Any, uow: SqlUnitOfWork) -> None:
            self.seen.append((label, event))
            await record_effect(uow, f"{label}:{event.message_name}")

        handler.__qualname__ = f"recording[{label}]"
        return handler

    async def effects(self) -> list[str]:
        async with self.container.database().session() as session:
            return await effects(session)


async def install_kit(container: Container, *, create_tables: bool = True) -> Kit:
    """Register the kit's messages and adapters on ``container`` and (re)create its tables."""
    container.registry().register(Created, Incremented, Noted, CounterChangedV1, RecordEffect)
    adapters = dict(container.units_of_work().adapters)
    adapters[Counters] = SqlCounters
    container.units_of_work().adapters = adapters
    if not create_tables:
        return Kit(container)
    engine = container.database().engine
    async with engine.begin() as connection:
        await connection.run_sync(metadata.create_all)
        for table in metadata.sorted_tables:  # the PostgreSQL test database lives for a session
            await connection.execute(table.delete())
    return Kit(container)
