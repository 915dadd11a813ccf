"""Alembic environment (async): the metadata of the outbox tables and every context's tables.

``render_as_batch`` is always on, so ALTERs work on SQLite (which cannot alter columns in
place). What it migrates comes from the caller (``config.attributes["database_url"]`` and
``["schema"]``: ``python -m <package> migrate`` runs it once per source), or from the settings:
the default source, or the source ``alembic -x source=<name> ...`` names.

Every source gets the same history (one version table each, in its database or schema): a
context's rows only ever land in its own source, and moving a context to a source of its own
needs no migration of the schema.
"""

import asyncio
from logging.config import fileConfig

# Every table the kit owns: a module left out here is a table autogenerate would drop.
import outbox_kit.persistence.tables  # noqa: F401
from alembic import context
from outbox_kit.runtime.sources import plan_sources
from sqlalchemy import text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine
from sqlmodel import SQLModel

from {{ cookiecutter.package_name }}.container import build_modules
from {{ cookiecutter.package_name }}.settings import (
    Settings,
)

config = context.config
if config.config_file_name is not None and not config.attributes.get("database_url"):
    fileConfig(config.config_file_name, disable_existing_loggers=False)

modules = build_modules()  # imports every bounded context's table module
target_metadata = SQLModel.metadata


def migrated() -> tuple[str, str | None]:
    """The database URL and the PostgreSQL schema (None: the database's own) to migrate."""
    url = config.attributes.get("database_url")
    if url:
        return str(url), config.attributes.get("schema")
    name = context.get_x_argument(as_dictionary=True).get("source", "default")
    plans = {plan.name: plan for plan in plan_sources(Settings(), modules)}
    if name not in plans:
        msg = f"-x source={name}: this service has the sources {', '.join(plans)}"
        raise SystemExit(msg)
    return plans[name].database.url, plans[name].schema


def run_migrations_offline() -> None:
    context.configure(
        url=migrated()[0],
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=True,
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()


def do_run_migrations(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=True,
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


async def create_schema(url: str, schema: str) -> None:
    """Before the migrating engine connects: its first connection learns its default schema."""
    engine = create_async_engine(url)
    async with engine.begin() as connection:  # a plain identifier: the settings refuse any other
        await connection.execute(text(f'CREATE SCHEMA IF NOT EXISTS "{schema}"'))
    await engine.dispose()


async def run_async_migrations() -> None:
    url, schema = migrated()
    connect_args = {}
    if schema:  # a source in a schema of its own: every statement, the version table's too, goes there
        await create_schema(url, schema)
        connect_args = {"server_settings": {"search_path": schema}}
    engine = create_async_engine(url, connect_args=connect_args)
    async with engine.connect() as connection:
        await connection.run_sync(do_run_migrations)
    await engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    asyncio.run(run_async_migrations())
