"""Several sources: a bounded context that keeps its data in a database or a PostgreSQL schema of
its own, with its own outbox, inbox and internal-commands tables.

Two contexts: ``sales`` (the default source) records a sale, schedules a count of it and
publishes ``SaleMade``; ``ledger`` (a source of its own) consumes ``SaleMade`` into a ledger entry
and schedules an audit of it. Each scenario runs on two SQLite files, on two schemas of one
PostgreSQL database and on two PostgreSQL databases."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
import pytest
import sqlalchemy as sa
from dependency_injector import providers
from outbox_kit.application.context import current_context
from outbox_kit.application.handlers import ContextSource, HandlerRegistry, Module
from outbox_kit.application.messages import IntegrationEvent, InternalCommand
from outbox_kit.application.unit_of_work import AdapterScope, UnitOfWork
from outbox_kit.persistence.database import Database, DatabaseSettings
from outbox_kit.persistence.tables import INBOX_TABLE, OUTBOX_TABLE
from outbox_kit.persistence.unit_of_work import CrossSourceError
from outbox_kit.runtime.app import create_app
from outbox_kit.runtime.container import OutboxContainer
from outbox_kit.runtime.settings import ServiceSettings
from outbox_kit.runtime.sources import SourcesError, plan_sources
from outbox_kit.testing.fixtures import (
    CONTAINER_VARIABLE,
    SERVICE_URLS,
    acting_as,
    create_postgres_database,
    drop_postgres_database,
    make_settings,
    run_async,
    service_argv,
    service_env,
    token_for,
)
from outbox_kit.testing.harness import TcpProxy, tcp_proxy
from sqlalchemy.engine import make_url
from sqlmodel import SQLModel

# -- two contexts ------------------------------------------------------------------------------

tables = sa.MetaData()  # created in every source, as one migration history would
SALES = sa.Table(
    "src_sales",
    tables,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("tenant_id", sa.String(64)),
)
# Effects have a row id of their own: an effect applied twice shows as two rows.
SALE_COUNTS = sa.Table(
    "src_sale_counts",
    tables,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("sale_id", sa.String(64), nullable=False),
)
LEDGER = sa.Table(
    "src_ledger",
    tables,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("sale_id", sa.String(64), nullable=False),
    sa.Column("tenant_id", sa.String(64)),
    sa.Column("user_id", sa.String(64)),
    sa.Column("correlation_id", sa.String(64)),
)
AUDITS = sa.Table(
    "src_audits",
    tables,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("sale_id", sa.String(64), nullable=False),
)


class SaleMadeV1(IntegrationEvent, name="src.sale-made.v1"):
    sale_id: str


class CountSale(InternalCommand, name="src.count-sale.v1"):
    sale_id: str


class AuditEntry(InternalCommand, name="src.audit-entry.v1"):
    sale_id: str


class Sales(Protocol):
    async def record(self, sale_id: str) -> None: ...


class Ledger(Protocol):
    async def record(self, sale_id: str) -> None: ...


class SqlSales:
    def __init__(self, scope: AdapterScope) -> None:
        self.scope = scope

    async def record(self, sale_id: str) -> None:
        tenant = current_context().tenant_id
        await self.scope.session.exec(sa.insert(SALES).values(id=sale_id, tenant_id=tenant))  # type: ignore[call-overload]


class SqlLedger:
    def __init__(self, scope: AdapterScope) -> None:
        self.scope = scope

    async def record(self, sale_id: str) -> None:
        context = current_context()
        entry = {
            "sale_id": sale_id,
            "tenant_id": context.tenant_id,
            "user_id": context.user_id,
            "correlation_id": context.correlation_id,
        }
        await self.scope.session.exec(sa.insert(LEDGER).values(entry))  # type: ignore[call-overload]


async def make_sale(uow: UnitOfWork, sale_id: str) -> None:
    await uow.repository(Sales).record(sale_id)
    uow.schedule(CountSale(sale_id=sale_id))
    uow.enqueue(SaleMadeV1(sale_id=sale_id))


async def count_sale(command: CountSale, uow: Any) -> None:
    await uow.session.exec(sa.insert(SALE_COUNTS).values(sale_id=command.sale_id))


async def on_sale_made(event: SaleMadeV1, uow: UnitOfWork) -> None:
    await uow.repository(Ledger).record(event.sale_id)
    uow.schedule(AuditEntry(sale_id=event.sale_id))


async def audit_entry(command: AuditEntry, uow: Any) -> None:
    await uow.session.exec(sa.insert(AUDITS).values(sale_id=command.sale_id))


def register_sales(handlers: HandlerRegistry) -> None:
    handlers.on_command(CountSale, count_sale)


def register_ledger(handlers: HandlerRegistry) -> None:
    handlers.consume("ledger.sale-made", SaleMadeV1, on_sale_made)
    handlers.on_command(AuditEntry, audit_entry)


def modules(ledger_default: ContextSource | None = None) -> list[Module]:
    return [
        Module(
            name="ledger",
            messages=(SaleMadeV1, AuditEntry),
            register_handlers=register_ledger,
            adapters={Ledger: SqlLedger},
            source=ledger_default,
        ),
        Module(
            name="sales", messages=(CountSale,), register_handlers=register_sales, adapters={Sales: SqlSales}
        ),
    ]


def two_contexts(settings: ServiceSettings) -> OutboxContainer:
    """The container of a service of the two contexts (also what the worker processes build)."""
    return OutboxContainer(settings=providers.Object(settings), modules=providers.Object(modules()))


# -- two sources ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Storage:
    """Where the default source and the ledger's are: URLs and the ledger's schema."""

    default_url: str
    ledger: ContextSource

    @property
    def ledger_url(self) -> str:
        return self.ledger.database_url or self.default_url

    def process_env(self) -> dict[str, str]:
        """What a process of the two-context service needs beside ``service_env``: the ledger's
        source and the container to build."""
        env = {
            "SOURCES__LEDGER__DATABASE_URL": self.ledger_url,
            CONTAINER_VARIABLE: f"{__name__}:two_contexts",
        }
        if self.ledger.schema_name:
            env["SOURCES__LEDGER__SCHEMA"] = self.ledger.schema_name
        return env


async def create_source_tables(url: str, schema: str | None) -> None:
    database = Database(DatabaseSettings(url=url), schema=schema)
    try:
        async with database.engine.begin() as connection:
            if schema is not None:
                await connection.execute(sa.text(f'CREATE SCHEMA IF NOT EXISTS "{schema}"'))
            await connection.run_sync(SQLModel.metadata.create_all)
            await connection.run_sync(tables.create_all)
    finally:
        await database.dispose()


POSTGRES_KINDS = [
    pytest.param("postgres-schemas", marks=pytest.mark.postgres),
    pytest.param("postgres-databases", marks=pytest.mark.postgres),
]


@pytest.fixture(params=["sqlite-files", *POSTGRES_KINDS])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Storage]:
    yield from prepared(request.param, tmp_path)


@pytest.fixture(params=POSTGRES_KINDS)
def postgres_storage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Storage]:
    yield from prepared(request.param, tmp_path)


def prepared(kind: str, tmp_path: Path) -> Iterator[Storage]:
    created: list[str] = []
    if kind == "sqlite-files":
        found = Storage(
            f"sqlite+aiosqlite:///{tmp_path / 'service.db'}",
            ContextSource(database_url=f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}"),
        )
    elif kind == "postgres-schemas":
        created.append(create_postgres_database())
        found = Storage(created[0], ContextSource(schema="ledger"))
    else:
        created += [create_postgres_database(), create_postgres_database()]
        found = Storage(created[0], ContextSource(database_url=created[1]))
    run_async(create_source_tables(found.default_url, None))
    run_async(create_source_tables(found.ledger_url, found.ledger.schema_name))
    yield found
    for url in created:
        drop_postgres_database(url)


Build = Any  # (**sections) -> OutboxContainer


@pytest.fixture
async def build(storage: Storage) -> AsyncIterator[Build]:
    async with builder(storage) as factory:
        yield factory


@pytest.fixture
async def build_on_postgres(postgres_storage: Storage) -> AsyncIterator[Build]:
    async with builder(postgres_storage) as factory:
        yield factory


@asynccontextmanager
async def builder(storage: Storage) -> AsyncIterator[Build]:
    built: list[OutboxContainer] = []

    def factory(ledger: ContextSource | None = None, **sections: dict[str, Any]) -> OutboxContainer:
        source = storage.ledger if ledger is None else ledger
        settings = make_settings(storage.default_url, **sections).model_copy(
            update={"sources": {"ledger": source}}
        )
        container = two_contexts(settings)
        built.append(container)
        return container

    yield factory
    for container in built:
        await container.data_sources().dispose()


async def rows(container: OutboxContainer, source: str, statement: Any) -> list[Any]:
    async with container.data_sources().named(source).database.session() as session:
        return list((await session.exec(statement)).all())


async def sell(container: OutboxContainer, sale_id: str, **context: Any) -> None:
    with acting_as(**context):
        await container.units_of_work()().run(lambda uow: make_sale(uow, sale_id))


async def until(check: Any, timeout: float = 30.0) -> None:
    """Until ``check()`` holds; a read that fails meanwhile (a source coming back: its pool's
    first use of a connection the outage closed) is tried again."""
    deadline = asyncio.get_running_loop().time() + timeout
    last: BaseException | None = None
    while True:
        try:
            if await check():
                return
        except sa.exc.DBAPIError as error:
            last = error
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not reached in {timeout} s (last error: {last})")
        await asyncio.sleep(0.1)


@asynccontextmanager
async def running(container: OutboxContainer) -> AsyncIterator[None]:
    worker = container.worker()
    await worker.start()
    try:
        yield
    finally:
        await worker.stop()


# -- what the settings say --------------------------------------------------------------------


def test_each_context_has_its_source_and_nothing_changes_without_one(tmp_path: Path) -> None:
    settings = make_settings(f"sqlite+aiosqlite:///{tmp_path / 'a.db'}")
    (default,) = plan_sources(settings, modules())
    assert (default.name, default.contexts) == ("default", ("ledger", "sales"))

    declared = ContextSource(database_url=f"sqlite+aiosqlite:///{tmp_path / 'declared.db'}")
    plans = plan_sources(settings, modules(declared))
    assert [(p.name, p.contexts, p.database.url) for p in plans] == [
        ("default", ("sales",), settings.database.url),
        ("ledger", ("ledger",), declared.database_url),
    ]
    overridden = settings.model_copy(
        update={"sources": {"ledger": ContextSource(database_url="sqlite+aiosqlite:///x.db")}}
    )
    assert (
        plan_sources(overridden, modules(declared))[1].database.url == "sqlite+aiosqlite:///x.db"
    )  # settings win


def test_the_sources_settings_are_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SOURCES__LEDGER__SCHEMA", "books")
    monkeypatch.setenv("SOURCES__SALES__DATABASE_URL", "postgresql+asyncpg://localhost/sales")
    settings = ServiceSettings()
    assert settings.sources == {
        "ledger": ContextSource(schema="books"),
        "sales": ContextSource(database_url="postgresql+asyncpg://localhost/sales"),
    }


@pytest.mark.parametrize(
    ("sources", "refusal"),
    [
        ({"billing": ContextSource(schema="b")}, "SOURCES__BILLING: no bounded context is named 'billing'"),
        ({"ledger": ContextSource(schema="books")}, "SOURCES__LEDGER__SCHEMA needs a PostgreSQL database"),
        (
            {"ledger": ContextSource(database_url="sqlite+aiosqlite:///same.db")},
            "SOURCES__LEDGER: the context would share the storage of source 'default'",
        ),
    ],
)
def test_sources_that_cannot_be_honoured_stop_the_start_with_the_reason(
    sources: dict[str, ContextSource], refusal: str
) -> None:
    settings = make_settings("sqlite+aiosqlite:///same.db").model_copy(update={"sources": sources})
    with pytest.raises(SourcesError, match=refusal.replace("(", r"\(")):
        plan_sources(settings, modules())


@pytest.mark.parametrize("name", ["default", "all", "outbox", "internal_commands"])
def test_a_context_named_as_operators_name_tables_keeps_the_default_source(name: str) -> None:
    """``--source outbox`` must keep meaning the default source's outbox."""
    own = {name: ContextSource(database_url="sqlite+aiosqlite:///other.db")}
    settings = make_settings("sqlite+aiosqlite:///same.db").model_copy(update={"sources": own})
    with pytest.raises(SourcesError, match=f"a context named '{name}' cannot have a source of its own"):
        plan_sources(settings, [Module(name=name)])


@pytest.mark.parametrize("schema", ["Books", "books; DROP TABLE x", "1books", "b" * 64])
def test_a_schema_name_that_is_not_a_plain_identifier_is_refused(schema: str) -> None:
    with pytest.raises(ValueError, match="schema"):
        ContextSource(schema=schema)


# -- the flow across two sources --------------------------------------------------------------


async def test_an_event_crosses_from_one_source_to_another_once_with_its_context(build: Build) -> None:
    container = build()
    async with running(container):
        await sell(container, "s-1", tenant="globex", user="bob", correlation_id="c-9")
        await until(lambda: audited(container, ["s-1"]))
    assert await rows(container, "default", sa.select(SALES.c.id, SALES.c.tenant_id)) == [("s-1", "globex")]
    assert await rows(container, "default", sa.select(SALE_COUNTS.c.sale_id)) == [("s-1",)]
    ledger = sa.select(LEDGER.c.sale_id, LEDGER.c.tenant_id, LEDGER.c.user_id, LEDGER.c.correlation_id)
    assert await rows(container, "ledger", ledger) == [("s-1", "globex", "bob", "c-9")]
    # each table in its own source, and only there
    assert await rows(container, "ledger", sa.select(SALES.c.id)) == []
    assert await rows(container, "default", sa.select(LEDGER.c.sale_id)) == []
    assert await rows(container, "default", sa.select(INBOX_TABLE.c.consumer)) == []
    assert await rows(container, "ledger", sa.select(INBOX_TABLE.c.consumer)) == [("ledger.sale-made",)]
    default_outbox = await rows(
        container, "default", sa.select(OUTBOX_TABLE.c.event_name, OUTBOX_TABLE.c.processed_on)
    )
    assert [name for name, processed in default_outbox if processed is not None] == ["src.sale-made.v1"]
    dispatched = {
        sample.labels["source"]
        for metric in container.metrics().registry.collect()
        for sample in metric.samples
        if sample.name == "outbox_dispatched_total" and sample.value > 0
    }
    assert dispatched == {"outbox", "internal_commands", "ledger.internal_commands"}  # the metrics say which
    counts = {c.source: (c.pending, c.dead_lettered) for c in await container.admin().count_pending()}
    assert counts == {
        "outbox": (0, 0),
        "internal_commands": (0, 0),
        "ledger.outbox": (0, 0),
        "ledger.internal_commands": (0, 0),
    }


async def audited(container: OutboxContainer, expected: list[str]) -> bool:
    found = await rows(container, "ledger", sa.select(AUDITS.c.sale_id).order_by(AUDITS.c.sale_id))
    return [row[0] for row in found] == expected


async def test_a_redelivered_event_lands_once_in_the_other_sources_inbox(build: Build) -> None:
    container = build()
    async with running(container):
        await sell(container, "s-1")
        await until(lambda: audited(container, ["s-1"]))
        (row,) = await rows(
            container, "default", sa.select(OUTBOX_TABLE).where(OUTBOX_TABLE.c.kind == "integration")
        )
        # the same row delivered again (a processor that lost its lease, a replay): a duplicate
        async with container.database().session() as session:
            await session.exec(  # type: ignore[call-overload]
                sa.update(OUTBOX_TABLE).where(OUTBOX_TABLE.c.id == row.id).values(processed_on=None)
            )
            await session.commit()
        container.wake().set()
        await until(lambda: nothing_pending(container))
    assert await rows(container, "ledger", sa.select(LEDGER.c.sale_id)) == [("s-1",)]
    assert await rows(container, "ledger", sa.select(AUDITS.c.sale_id)) == [("s-1",)]


async def nothing_pending(container: OutboxContainer) -> bool:
    return all(count.pending == 0 for count in await container.admin().count_pending())


async def test_a_unit_of_work_across_two_sources_is_refused_and_writes_nothing(build: Build) -> None:
    container = build()

    async def both(uow: UnitOfWork) -> None:
        await uow.repository(Sales).record("s-1")
        await uow.repository(Ledger).record("s-1")

    with acting_as(), pytest.raises(CrossSourceError) as refused:
        await container.units_of_work()().run(both)
    assert "Ledger belongs to source 'ledger'" in str(refused.value)
    assert "this unit of work writes to source 'default'" in str(refused.value)
    assert "uow.enqueue" in str(refused.value)
    assert await rows(container, "default", sa.select(SALES.c.id)) == []
    # and the other way round: the ledger's units of work refuse the sales context's port
    with acting_as(), pytest.raises(CrossSourceError, match="Sales belongs to source 'default'"):
        await container.data_sources().named("ledger").units().run(both_ledger_first)


async def both_ledger_first(uow: UnitOfWork) -> None:
    await uow.repository(Ledger).record("s-1")
    await uow.repository(Sales).record("s-1")


async def test_a_route_of_a_context_gets_the_units_of_work_of_its_source(build: Build) -> None:
    from fastapi import APIRouter, Depends
    from outbox_kit.runtime.http import units_of_work

    router = APIRouter()

    @router.get("/ledger-source")
    async def which(units: Any = Depends(units_of_work)) -> dict[str, str]:
        return {"source": units.source}

    container = build()
    ledger = container.modules()[0]
    container.modules.override(
        providers.Object([Module(**{**ledger.__dict__, "routers": (router,)}), container.modules()[1]])
    )
    app = create_app(container)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        answered = (await client.get("/ledger-source")).json()
    assert answered == {"source": "ledger"}


async def test_readiness_lists_each_source(build: Build) -> None:
    container = build()
    app = create_app(container)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        ready = await client.get("/readyz")
    assert ready.json()["checks"] == {"database": "ok", "database:ledger": "ok", "bus": "ok"}


async def test_operators_name_a_source_or_one_of_its_tables(build: Build) -> None:
    container = build()
    with acting_as():
        await container.data_sources().named("ledger").units().run(schedule_audit)
    admin = container.admin()
    assert [c.source for c in await admin.count_pending("ledger")] == [
        "ledger.outbox",
        "ledger.internal_commands",
    ]
    assert [(c.source, c.pending) for c in await admin.count_pending("ledger.internal_commands")] == [
        ("ledger.internal_commands", 1)
    ]
    assert [(c.source, c.pending) for c in await admin.count_pending("internal_commands")] == [
        ("internal_commands", 0)
    ]
    (row,) = await rows(
        container, "ledger", sa.select(sa.column("id")).select_from(sa.table("internal_commands"))
    )
    explained = await admin.explain("ledger.internal_commands", str(row.id))
    assert (explained.source, explained.name) == ("ledger.internal_commands", "src.audit-entry.v1")
    with pytest.raises(ValueError, match=r"unknown source 'books'; use one of: outbox, internal_commands, "):
        await admin.count_pending("books")
    # a dead letter of the ledger's is replayed there, and the replay recorded there
    commands = sa.table("internal_commands", sa.column("id"), sa.column("dead_lettered_on"))
    async with container.data_sources().named("ledger").database.session() as session:
        await session.exec(sa.update(commands).values(dead_lettered_on=sa.func.now()))  # type: ignore[call-overload]
        await session.commit()
    assert [letter.source for letter in await admin.list_dead_letters()] == ["ledger.internal_commands"]
    replayed = await admin.replay("ledger.internal_commands", [str(row.id)], actor="ops")
    assert (replayed.source, replayed.replayed) == ("ledger.internal_commands", [str(uuid.UUID(str(row.id)))])
    replays = "SELECT source, replayed_by FROM dead_letter_replays"
    assert await rows(container, "ledger", sa.text(replays)) == [("internal_commands", "ops")]
    assert await rows(container, "default", sa.text(replays)) == []


async def test_the_admin_api_names_the_sources_of_the_service(build: Build) -> None:
    container = build()
    with acting_as():
        await container.data_sources().named("ledger").units().run(schedule_audit)
    (row,) = await rows(
        container, "ledger", sa.select(sa.column("id")).select_from(sa.table("internal_commands"))
    )
    headers = {"Authorization": f"Bearer {token_for(container, roles=('outbox-operator',))}"}
    app = create_app(container)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://test", headers=headers
    ) as client:
        pending = (await client.get("/admin/outbox/pending", params={"source": "ledger"})).json()
        explained = (await client.get(f"/admin/outbox/ledger.internal_commands/{row.id}/explain")).json()
        unknown = await client.get("/admin/outbox/pending", params={"source": "books"})
        a_source_is_not_a_table = await client.get(f"/admin/outbox/ledger/{row.id}/explain")
    assert [(c["source"], c["pending"]) for c in pending] == [
        ("ledger.outbox", 0),
        ("ledger.internal_commands", 1),
    ]
    assert explained["name"] == "src.audit-entry.v1"
    assert (unknown.status_code, a_source_is_not_a_table.status_code) == (422, 422)
    assert "'ledger.internal_commands'" in unknown.json()["detail"][0]["msg"]


async def test_the_outbox_command_line_takes_a_source(build: Build, storage: Storage) -> None:
    """``outbox pending --source ledger``, a real process of the two-context service."""
    container = build()
    with acting_as():
        await container.data_sources().named("ledger").units().run(schedule_audit)
    env = service_env(storage.default_url, **storage.process_env())
    result = await asyncio.to_thread(
        subprocess.run,
        service_argv("outbox", "pending", "--source", "ledger"),
        cwd=Path(__file__).parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    counted = [(c["source"], c["pending"]) for c in json.loads(result.stdout)]
    assert counted == [("ledger.outbox", 0), ("ledger.internal_commands", 1)]


def test_a_source_the_command_line_cannot_honour_is_one_line_and_status_2(tmp_path: Path) -> None:
    env = service_env(
        f"sqlite+aiosqlite:///{tmp_path / 'service.db'}",
        SOURCES__LEDGER__SCHEMA="books",
        **{CONTAINER_VARIABLE: f"{__name__}:two_contexts"},
    )
    result = subprocess.run(
        service_argv("outbox", "pending"),
        cwd=Path(__file__).parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: configuration error: SOURCES__LEDGER__SCHEMA needs a PostgreSQL database; on SQLite "
        "give the context a file of its own (SOURCES__LEDGER__DATABASE_URL)"
    )


async def schedule_audit(uow: UnitOfWork) -> None:
    uow.schedule(AuditEntry(sale_id="s-0"))


# -- one source down ---------------------------------------------------------------------------


@asynccontextmanager
async def line_to(url: str) -> AsyncIterator[tuple[TcpProxy, str]]:
    parsed = make_url(url)
    async with tcp_proxy(parsed.host or "127.0.0.1", parsed.port or 5432) as proxy:
        yield proxy, parsed.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)


async def test_a_source_that_is_down_pauses_only_its_own_rows_and_loses_nothing(
    build_on_postgres: Build, postgres_storage: Storage
) -> None:
    """PostgreSQL only: the outage is the line to the ledger's database cut (SQLite has none)."""
    storage = postgres_storage
    async with line_to(storage.ledger_url) as (proxy, ledger_url):
        container = build_on_postgres(
            ContextSource(database_url=ledger_url, schema=storage.ledger.schema_name)
        )
        async with running(container):
            await sell(container, "s-1")
            await until(lambda: audited(container, ["s-1"]))
            await proxy.cut()
            for n in range(2, 6):
                await sell(container, f"s-{n}")
            # the default source keeps flowing: every sale is counted while the ledger is down
            await until(lambda: counted(container, [f"s-{n}" for n in range(1, 6)]))
            app = create_app(container)
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://t"
            ) as client:
                answer = await client.get("/readyz")
            ready = answer.json()
            assert answer.status_code == 200, ready  # the default source serves: still ready
            assert ready["status"] == "degraded"
            assert ready["checks"]["database"] == "ok"
            assert ready["checks"]["database:ledger"].startswith("error")
            await proxy.start()  # the line is back on the same port
            await until(lambda: audited(container, [f"s-{n}" for n in range(1, 6)]), timeout=60)
            await until(lambda: nothing_pending(container), timeout=60)
        ledger = await rows(container, "ledger", sa.select(LEDGER.c.sale_id).order_by(LEDGER.c.sale_id))
        assert [row[0] for row in ledger] == [f"s-{n}" for n in range(1, 6)]  # each once
        dead = [c for c in await container.admin().count_pending() if c.dead_lettered]
        assert dead == []  # an outage is never charged to a row


def routed(container: OutboxContainer) -> None:
    """Give each context a route that writes to its source: ``POST /sales/{id}`` (default
    source) and ``POST /ledger/{id}`` (the ledger's)."""
    from fastapi import APIRouter, Depends
    from outbox_kit.runtime.http import units_of_work

    sales, ledger = APIRouter(), APIRouter()

    @sales.post("/sales/{sale_id}", status_code=201)
    async def record_sale(sale_id: str, units: Any = Depends(units_of_work)) -> dict[str, str]:
        await units().run(lambda uow: make_sale(uow, sale_id))
        return {"id": sale_id}

    @ledger.post("/ledger/{sale_id}", status_code=201)
    async def record_entry(sale_id: str, units: Any = Depends(units_of_work)) -> dict[str, str]:
        await units().run(lambda uow: uow.repository(Ledger).record(sale_id))
        return {"id": sale_id}

    ledger_module, sales_module = container.modules()
    container.modules.override(
        providers.Object(
            [
                Module(**{**ledger_module.__dict__, "routers": (ledger,)}),
                Module(**{**sales_module.__dict__, "routers": (sales,)}),
            ]
        )
    )


async def test_a_source_that_is_down_keeps_the_service_ready_and_only_its_routes_answer_503(
    build_on_postgres: Build, postgres_storage: Storage
) -> None:
    """PostgreSQL only (the outage is the line to the ledger's database cut): the API and the
    worker stay ready, say which source is down, and the per-source probe fails; the ledger's
    route answers 503 naming its context, the default source's route answers as always."""
    from outbox_kit.runtime.app import create_worker_app

    async with line_to(postgres_storage.ledger_url) as (proxy, ledger_url):
        container = build_on_postgres(
            ContextSource(database_url=ledger_url, schema=postgres_storage.ledger.schema_name)
        )
        routed(container)
        auth = {"Authorization": f"Bearer {token_for(container)}"}
        api, worker = create_app(container), create_worker_app(container)
        async with (
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app=api), base_url="http://api", timeout=30
            ) as client,
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app=worker), base_url="http://w", timeout=30
            ) as probe,
        ):
            assert (await client.post("/ledger/e-1", headers=auth)).status_code == 201
            await proxy.cut()

            for app_client in (client, probe):
                ready = await app_client.get("/readyz")
                assert ready.status_code == 200, ready.text
                assert ready.json()["status"] == "degraded"
                assert ready.json()["checks"]["database"] == "ok"
                assert ready.json()["checks"]["bus"] == "ok"
                assert ready.json()["checks"]["database:ledger"].startswith("error"), ready.text
                for asked in ("ledger", "all"):
                    assert (await app_client.get(f"/readyz?source={asked}")).status_code == 503
                assert (await app_client.get("/readyz?source=default")).status_code == 200
                assert (await app_client.get("/livez")).status_code == 200
            unknown = await client.get("/readyz?source=billing")
            assert unknown.status_code == 404
            assert unknown.json()["detail"] == "no source named 'billing'; the sources: default, ledger, all"

            refused = await client.post("/ledger/e-2", headers=auth)
            assert refused.status_code == 503, refused.text
            assert refused.json() == {
                "detail": "the ledger context's database (source 'ledger') is unavailable",
                "code": "database_unavailable",
            }
            assert refused.headers["retry-after"] == "1"
            assert (await client.post("/sales/s-1", headers=auth)).status_code == 201

            await proxy.start()  # the line is back on the same port
            for app_client in (client, probe):
                await until(lambda c=app_client: all_ready(c))
            assert (await client.post("/ledger/e-3", headers=auth)).status_code == 201
        ledger_rows = await rows(container, "ledger", sa.select(LEDGER.c.sale_id).order_by(LEDGER.c.sale_id))
        assert [row[0] for row in ledger_rows] == ["e-1", "e-3"]  # the refused one wrote nothing


async def all_ready(client: httpx.AsyncClient) -> bool:
    answer = await client.get("/readyz?source=all")
    return answer.status_code == 200 and answer.json()["status"] == "ok"


async def counted(container: OutboxContainer, expected: list[str]) -> bool:
    found = await rows(container, "default", sa.select(SALE_COUNTS.c.sale_id).order_by(SALE_COUNTS.c.sale_id))
    return [row[0] for row in found] == expected


# -- the reliability tier's kill scenario, with two sources -----------------------------------

SALES_SENT = 300


@dataclass
class Fleet:
    """Worker processes of the two-context service (``python -m outbox_kit.testing.processes
    service worker``), each logging to a file of its own."""

    env: dict[str, str]
    logs: Path
    processes: dict[str, subprocess.Popen[str]] = field(default_factory=dict)
    kills: int = 0

    def start(self, name: str) -> None:
        with (self.logs / f"{name}-{self.kills}.log").open("w") as log:  # the child keeps its copy
            self.processes[name] = subprocess.Popen(
                service_argv("worker"),
                cwd=Path(__file__).parent,
                env=self.env,
                stdout=log,
                stderr=log,
                text=True,
            )

    async def started(self, name: str) -> None:
        log = self.logs / f"{name}-{self.kills}.log"
        for _ in range(600):
            if "worker started" in log.read_text():
                return
            assert self.processes[name].poll() is None, log.read_text()[-3000:]
            await asyncio.sleep(0.1)
        raise AssertionError(f"{name} did not start: {log.read_text()[-3000:]}")

    def kill(self, name: str) -> None:
        self.processes[name].kill()
        self.processes[name].wait()
        self.kills += 1

    def stop_all(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.mark.slow
@pytest.mark.rabbitmq
async def test_workers_killed_at_random_lose_nothing_and_duplicate_nothing_across_two_sources(
    build: Build, storage: Storage, tmp_path: Path
) -> None:
    """300 sales drained by two worker processes (RabbitMQ between the sources) while one of them,
    chosen at random, is SIGKILLed and restarted three times: every sale is counted (the default
    source's internal command), entered in the ledger (the consumer, in the ledger's source) and
    audited (the ledger's internal command) exactly once; nothing is dead-lettered or left. On
    two SQLite files (the workers share them, as API and worker share the embedded file), two
    schemas and two PostgreSQL databases."""
    namespace = f"src{uuid.uuid4().hex[:8]}"
    bus = {"transport": "rabbitmq", "url": SERVICE_URLS["rabbitmq"]}
    container = build(application={"namespace": namespace}, message_bus=bus)
    await container.bus().start()  # declares the ledger's queue before anything is published
    env = service_env(
        storage.default_url,
        APPLICATION__NAMESPACE=namespace,
        MESSAGE_BUS__TRANSPORT="rabbitmq",
        MESSAGE_BUS__URL=SERVICE_URLS["rabbitmq"],
        OUTBOX__LEASE_SECONDS="3",  # a killed worker's rows come back soon
        OUTBOX__DELIVERY_TIMEOUT_SECONDS="2",  # within the lease, with its margin
        MESSAGE_BUS__PUBLISH_TIMEOUT_SECONDS="1",
        OUTBOX__POLLING_INTERVAL_SECONDS="0.2",
        LOGGING__LEVEL="INFO",
        # Two processes, two sources each, two engines per source: with the default pool they
        # opened up to 74 PostgreSQL connections, and the rest of the suite runs beside them
        # (the server's 100 ran out). Three per pool still runs every handler the batch allows.
        DATABASE__POOL_SIZE="3",
        **storage.process_env(),
    )
    fleet = Fleet(env, tmp_path)
    try:
        for name in ("w1", "w2"):
            fleet.start(name)
        for name in ("w1", "w2"):
            await fleet.started(name)
        sent = [f"s-{n:04d}" for n in range(SALES_SENT)]
        for first in range(0, SALES_SENT, 25):
            await sell_many(container, sent[first : first + 25])
        chaos, pending_at_kills = random.Random(), []
        for kill in range(3):
            await asyncio.sleep(chaos.uniform(0.1, 0.6) if kill == 0 else chaos.uniform(0.3, 2.0))
            pending_at_kills.append(sum(c.pending for c in await container.admin().count_pending()))
            victim = chaos.choice(sorted(fleet.processes))
            fleet.kill(victim)
            fleet.start(victim)
        await until(lambda: covers(container, "ledger", AUDITS, sent), timeout=240)
        await until(lambda: covers(container, "default", SALE_COUNTS, sent), timeout=60)
        await until(lambda: nothing_pending(container), timeout=60)
    finally:
        fleet.stop_all()
        await container.bus().stop()
        await container.bus().delete_topology()  # type: ignore[attr-defined]
    for source, table in (("default", SALE_COUNTS), ("ledger", LEDGER), ("ledger", AUDITS)):
        found = await rows(container, source, sa.select(table.c.sale_id).order_by(table.c.sale_id))
        assert [row[0] for row in found] == sent, table.name  # each exactly once
    assert all(count.dead_lettered == 0 for count in await container.admin().count_pending())
    assert fleet.kills == 3
    assert pending_at_kills[0] > 0, f"the kills fell after the drain ({pending_at_kills}): nothing proved"


async def covers(container: OutboxContainer, source: str, table: sa.Table, sent: list[str]) -> bool:
    """Every sale has its effect in ``table`` (a second copy is for the final count to see)."""
    found = await rows(container, source, sa.select(sa.func.count(sa.distinct(table.c.sale_id))))
    return int(found[0][0]) == len(sent)


async def sell_many(container: OutboxContainer, sale_ids: list[str]) -> None:
    async def make(uow: UnitOfWork) -> None:
        for sale_id in sale_ids:
            await make_sale(uow, sale_id)

    with acting_as():
        await container.units_of_work()().run(make)
