"""Alembic environment (async): the metadata of the outbox tables and every context's tables.

``render_as_batch`` is always on, so ALTERs work on SQLite (which cannot alter columns in
place). The URL comes from the caller (``config.attributes["database_url"]``) or from settings.
"""

import asyncio
from logging.config import fileConfig

# Every table the kit owns: a module left out here is a table autogenerate would drop.
import outbox_kit.persistence.tables  # noqa: F401
from alembic import context
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

build_modules()  # imports every bounded context's table module
target_metadata = SQLModel.metadata


def database_url() -> str:
    url = config.attributes.get("database_url")
    return str(url) if url else Settings().database.url


def run_migrations_offline() -> None:
    context.configure(
        url=database_url(),
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


async def run_async_migrations() -> None:
    engine = create_async_engine(database_url())
    async with engine.connect() as connection:
        await connection.run_sync(do_run_migrations)
    await engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    asyncio.run(run_async_migrations())
