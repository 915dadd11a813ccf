"""Migrations: every revision upgrades, downgrades and upgrades again (stairway), and the
models match the migrations (``alembic check``), on SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic.script import ScriptDirectory

from {{ cookiecutter.package_name }}.entrypoints import (
    migrations,
)

from ..conftest import create_postgres_database, drop_postgres_database, in_thread

pytestmark = pytest.mark.integration


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def empty_database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'stairway.db'}"
        return
    url = create_postgres_database()
    yield url
    drop_postgres_database(url)


def revisions() -> list[str]:
    script = ScriptDirectory.from_config(migrations.alembic_config())
    return [r.revision for r in reversed(list(script.walk_revisions()))]


def test_stairway_upgrade_downgrade_upgrade_each_revision(empty_database: str) -> None:
    previous = "base"
    for revision in revisions():
        in_thread(migrations.upgrade, empty_database, revision)
        in_thread(migrations.downgrade, empty_database, previous)
        in_thread(migrations.upgrade, empty_database, revision)
        previous = revision


def test_models_and_migrations_agree(empty_database: str) -> None:
    in_thread(migrations.upgrade, empty_database, "head")
    in_thread(migrations.check, empty_database)
    in_thread(migrations.downgrade, empty_database, "base")
    in_thread(migrations.upgrade, empty_database, "head")
