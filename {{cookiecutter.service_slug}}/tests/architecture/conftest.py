"""Fixtures of the architecture tier: a migrated SQLite file and a container on a copy of it.

The database is migrated once per session with the service's own migrations and copied for every
test, so each test starts from an empty, fully migrated schema in a few milliseconds.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from outbox_kit.runtime.cli import upgrade

from {{ cookiecutter.package_name }}.__main__ import PROJECT_ROOT
from {{ cookiecutter.package_name }}.container import (
    Container,
    build_container,
)
from {{ cookiecutter.package_name }}.settings import (
    DatabaseSettings,
    MessageBusSettings,
    OutboxSettings,
    Settings,
)

collect_ignore = ["fixtures"]


@pytest.fixture(scope="session")
async def migrated_database(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("architecture") / "migrated.db"
    await asyncio.to_thread(upgrade, PROJECT_ROOT, f"sqlite+aiosqlite:///{path}")
    return path


@pytest.fixture
async def service_container(tmp_path: Path, migrated_database: Path) -> AsyncIterator[Container]:
    """The service's container on a fresh SQLite file: outbox and inbox on, no processing delay."""
    path = tmp_path / "service.db"
    shutil.copyfile(migrated_database, path)
    settings = Settings(
        _env_file=None,
        database=DatabaseSettings(url=f"sqlite+aiosqlite:///{path}"),
        message_bus=MessageBusSettings(enable_outbox=True, enable_inbox=True),
        outbox=OutboxSettings(processing_delay_seconds=0),
    )
    container = build_container(settings)
    yield container
    await container.database().dispose()
