"""What the kit's tests and a service's framework tiers drive the kit with, without any
service's contexts:

- a tiny bounded context: a ``Counter`` aggregate with its own table (created by
  :func:`install_kit`, outside the migrations), events, an integration event and an internal
  command, so a service's tiers prove the kit whether or not its example was generated;
- a clock moved by hand, a scripted deliverer, and helpers that drive one processor source by
  hand over raw rows;
- a TCP proxy that cuts or freezes the line to a real server for one container only (stopping a
  shared server would break every other test on the machine)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

import sqlalchemy as sa
from sqlmodel.ext.asyncio.session import AsyncSession

from outbox_kit.application.clock import TimeLimit
from outbox_kit.application.context import (
    current_context,
)
from outbox_kit.application.messages import (
    IntegrationEvent,
    InternalCommand,
)
from outbox_kit.application.tracing import SpanKind
from outbox_kit.domain import (
    AggregateRoot,
    DomainEvent,
    applies,
)
from outbox_kit.persistence.repository import (
    Repository,
)
from outbox_kit.persistence.tables import COMMAND_TABLE, OUTBOX_TABLE
from outbox_kit.persistence.unit_of_work import SqlUnitOfWork
from outbox_kit.processor.claim import ClaimedRow
from outbox_kit.processor.cycle import TableSource
from outbox_kit.processor.processor import RowByRow, SourceSettings
from outbox_kit.runtime.container import OutboxContainer, source_settings
from outbox_kit.transports.bus import Delivered

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


CONSUMER = "kit.observer"  # the consumer the broker tests and the reliability tier subscribe


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
            await self.session.exec(
                sa.insert(COUNTERS).values(
                    id=aggregate.id, tenant_id=aggregate.tenant_id, value=aggregate.value, version=1
                )
            )
            return 1
        return await self._versioned_update(COUNTERS, aggregate, {"value": aggregate.value})


async def record_effect(uow: SqlUnitOfWork, label: str) -> None:
    """What a handler's state change looks like here: a row in the handler's transaction."""
    await uow.session.exec(sa.insert(EFFECTS).values(label=label, tenant_id=current_context().tenant_id))


async def effects(session: AsyncSession) -> list[str]:
    rows = await session.exec(sa.select(EFFECTS.c.label).order_by(EFFECTS.c.id))  # type: ignore[call-overload]
    return [row[0] for row in rows]


Handler = Callable[[Any, SqlUnitOfWork], Awaitable[None]]


@dataclass
class Kit:
    """The test context installed on one container."""

    container: OutboxContainer
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


def register_kit(container: OutboxContainer) -> None:
    """Register the kit's messages and adapters on ``container`` (its tables aside)."""
    container.registry().register(Created, Incremented, Noted, CounterChangedV1, RecordEffect)
    adapters = dict(container.units_of_work().adapters)
    adapters[Counters] = SqlCounters
    container.units_of_work().adapters = adapters


async def install_kit(container: OutboxContainer, *, create_tables: bool = True) -> Kit:
    """Register the kit's messages and adapters on ``container`` and (re)create its tables."""
    register_kit(container)
    if not create_tables:
        return Kit(container)
    engine = container.database().engine
    async with engine.begin() as connection:
        await connection.run_sync(metadata.create_all)
        for table in metadata.sorted_tables:  # the PostgreSQL test database lives for a session
            await connection.execute(table.delete())
    return Kit(container)


# -- driving a processor source by hand -------------------------------------------------------


class FakeClock:
    """A clock tests move by hand (the processor takes its time only from its clock)."""

    def __init__(self, start: datetime | None = None) -> None:
        self.now = start or datetime.now(UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


@dataclass
class ScriptedDeliverer(RowByRow):
    """Delivers by running ``script(row)``; records what it was asked to deliver."""

    script: Callable[[ClaimedRow], Awaitable[Delivered]] | None = None
    delivered: list[ClaimedRow] = field(default_factory=list)
    fresh_lease: bool = True  # like a handler; False like a publish (renewed only when short)

    def needs_fresh_lease(self, row: ClaimedRow) -> bool:
        del row
        return self.fresh_lease

    def span_kind(self, row: ClaimedRow) -> SpanKind:
        del row
        return SpanKind.INTERNAL

    async def deliver(self, row: ClaimedRow, token: uuid.UUID, limit: TimeLimit) -> Delivered:
        del token
        self.delivered.append(row)
        if self.script is not None:
            async with limit():  # the script stands for the handlers or the publish
                return await self.script(row)
        return Delivered.NEEDS_STAMP


def outbox_source(
    container: OutboxContainer, deliverer: Any, clock: FakeClock | None = None, **overrides: Any
) -> TableSource:
    return polled_source(container, "outbox", deliverer, clock, **overrides)


def command_source(
    container: OutboxContainer, clock: FakeClock | None = None, **overrides: Any
) -> TableSource:
    """The internal-command processor's source with the service's deliverer, on ``clock``."""
    return polled_source(container, "internal_commands", container.command_deliverer(), clock, **overrides)


def polled_source(
    container: OutboxContainer,
    name: str,
    deliverer: Any,
    clock: FakeClock | None = None,
    *,
    instance_id: str = "processor-a",
    **overrides: Any,
) -> TableSource:
    table, column = (OUTBOX_TABLE, "event_name") if name == "outbox" else (COMMAND_TABLE, "command_name")
    settings = source_settings(container.settings(), container.database())
    values = {**settings.__dict__, **overrides}
    return TableSource(
        name=name,
        table=table,
        name_column=column,
        settings=SourceSettings(**values),
        database=container.database(),
        deliverer=deliverer,
        clock=clock or container.clock(),
        instance_id=instance_id,
        metrics=container.metrics(),
    )


async def insert_rows(
    container: OutboxContainer, rows: list[dict[str, Any]], table: sa.Table = OUTBOX_TABLE
) -> list[uuid.UUID]:
    """Insert raw rows into a polled table, the outbox by default (seq assigned in list order)."""
    ids = []
    async with container.database().session() as session:
        for values in rows:
            row_id = values.pop("id", None) or uuid.uuid4()
            ids.append(row_id)
            statement = sa.insert(table).values(id=row_id, **values)
            if container.database().dialect != "postgresql":
                next_seq = sa.select(sa.func.coalesce(sa.func.max(table.c.seq), 0) + 1)
                statement = statement.values(seq=next_seq.scalar_subquery())
            await session.exec(statement)
        await session.commit()
    return ids


def row(
    name: str, at: datetime, key: str | None = None, kind: str = "integration", **extra: Any
) -> dict[str, Any]:
    return {
        "event_name": name,
        "kind": kind,
        "payload": extra.pop("payload", {}),
        "occurred_on": at,
        "available_on": at,
        "ordering_key": key,
        "retry_count": 0,
        **extra,
    }


async def state(container: OutboxContainer, row_id: uuid.UUID, table: sa.Table = OUTBOX_TABLE) -> Any:
    async with container.database().session() as session:
        return (await session.exec(sa.select(table).where(table.c.id == row_id))).one()  # type: ignore[call-overload]


async def all_rows(container: OutboxContainer) -> list[Any]:
    async with container.database().session() as session:
        return list((await session.exec(sa.select(OUTBOX_TABLE).order_by(OUTBOX_TABLE.c.seq))).all())  # type: ignore[call-overload]


# -- cutting the line to a server ---------------------------------------------------------------


class TcpProxy:
    """Forwards every connection on ``port`` to ``target_host:target_port`` until cut."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self._target = (target_host, target_port)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._flowing = asyncio.Event()
        self._flowing.set()
        self.port = 0

    def freeze(self) -> None:
        """Stop forwarding bytes but keep every socket open: a half-open line, as after a
        failover behind a load balancer. New connections are accepted and hang too."""
        self._flowing.clear()

    def thaw(self) -> None:
        self._flowing.set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        """Refuse new connections and drop the open ones (the port stays reserved).

        The open connections are closed before ``wait_closed()``: since Python 3.12.1 it waits
        for them, so awaiting it first hung for as long as a client kept its line."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for writer in list(self._writers):
            writer.close()
        self._writers.clear()
        if server is not None:
            await server.wait_closed()

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self._writers.add(client_writer)  # before the upstream connect, so a cut meanwhile drops it
        try:
            server_reader, server_writer = await asyncio.open_connection(*self._target)
        except OSError:
            client_writer.close()
            self._writers.discard(client_writer)
            return
        if client_writer not in self._writers:  # cut while connecting upstream
            server_writer.close()
            return
        self._writers.add(server_writer)
        await asyncio.gather(
            self._pipe(client_reader, server_writer), self._pipe(server_reader, client_writer)
        )

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(65536):
                await self._flowing.wait()
                writer.write(data)
                await writer.drain()
        writer.close()
        self._writers.discard(writer)


@contextlib.asynccontextmanager
async def tcp_proxy(target_host: str, target_port: int) -> AsyncIterator[TcpProxy]:
    proxy = TcpProxy(target_host, target_port)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.cut()
