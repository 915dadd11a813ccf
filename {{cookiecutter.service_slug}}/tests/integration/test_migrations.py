"""Migrations: every revision upgrades, downgrades and upgrades again (stairway), and the
models match the migrations (``alembic check``), on SQLite and PostgreSQL."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.script import ScriptDirectory
from outbox_kit.runtime import cli
from outbox_kit.testing.fixtures import create_postgres_database, drop_postgres_database, in_thread, run_async
from sqlalchemy.ext.asyncio import create_async_engine
from sqlmodel import SQLModel

from {{ cookiecutter.package_name }}.__main__ import PROJECT_ROOT

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
    script = ScriptDirectory.from_config(cli.alembic_config(PROJECT_ROOT))
    return [r.revision for r in reversed(list(script.walk_revisions()))]


def test_stairway_upgrade_downgrade_upgrade_each_revision(empty_database: str) -> None:
    previous = "base"
    for revision in revisions():
        in_thread(cli.upgrade, PROJECT_ROOT, empty_database, revision)
        in_thread(cli.downgrade, PROJECT_ROOT, empty_database, previous)
        in_thread(cli.upgrade, PROJECT_ROOT, empty_database, revision)
        previous = revision


def test_models_and_migrations_agree(empty_database: str) -> None:
    in_thread(cli.upgrade, PROJECT_ROOT, empty_database, "head")
    in_thread(cli.check, PROJECT_ROOT, empty_database)
    in_thread(cli.downgrade, PROJECT_ROOT, empty_database, "base")
    in_thread(cli.upgrade, PROJECT_ROOT, empty_database, "head")


async def stored_index_definitions(url: str) -> dict[str, str]:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as connection:
            if connection.dialect.name == "postgresql":
                query = "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'public'"
            else:
                query = "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL"
            return {row[0]: row[1] for row in await connection.execute(sa.text(query))}
    finally:
        await engine.dispose()


def test_partial_indexes_keep_their_predicates(empty_database: str) -> None:
    """``alembic check`` does not compare index predicates: a migration that lost a WHERE would
    pass it while the claim scans whole tables. Compare every partial index with the database."""
    in_thread(cli.upgrade, PROJECT_ROOT, empty_database, "head")
    stored = run_async(stored_index_definitions(empty_database))
    partial = [
        (index.name, str(where))
        for table in SQLModel.metadata.tables.values()
        for index in table.indexes
        if (where := index.dialect_options["postgresql"].get("where")) is not None
    ]
    assert len(partial) >= 14  # seven on each polled table
    for name, where in partial:
        definition = " ".join(stored[str(name)].split()).lower()
        assert " where " in definition, f"{name} lost its predicate: {definition}"
        for column in re.findall(r"[a-z_]+(?= is)", where.lower()):
            assert column in definition.split(" where ", 1)[1], f"{name}: {column} missing in {definition}"


PROJECT = Path(__file__).resolve().parents[2]


def command_line_copy(tmp_path: Path, *, drop_head: bool) -> tuple[Path, str]:
    """The project's Alembic setup copied aside (the revision is written there, not into the
    project), and an SQLite database at its head; ``drop_head`` leaves the newest revision out,
    so autogenerate has something to write."""
    copy = tmp_path / "project"
    copy.mkdir()
    for name in ("alembic.ini", "pyproject.toml"):
        shutil.copy(PROJECT / name, copy / name)
    shutil.copytree(PROJECT / "migrations", copy / "migrations", ignore=shutil.ignore_patterns("__pycache__"))
    if drop_head:
        script = ScriptDirectory.from_config(cli.alembic_config(PROJECT_ROOT))
        head = script.get_revision(script.get_current_head())
        assert head is not None
        Path(copy / "migrations" / "versions" / Path(head.path).name).unlink()
    url = f"sqlite+aiosqlite:///{tmp_path / 'cli.db'}"
    alembic(copy, url, "upgrade", "head")
    return copy, url


def alembic(copy: Path, url: str, *arguments: str) -> str:
    """The documented command line: ``alembic`` run in the project (``prepend_sys_path = src``)."""
    result = subprocess.run(
        [sys.executable, "-m", "alembic", "-c", str(copy / "alembic.ini"), *arguments],
        cwd=PROJECT,
        env={k: v for k, v in os.environ.items() if "__" not in k} | {"DATABASE__URL": url},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout + result.stderr


def autogenerate(copy: Path, url: str) -> Path:
    alembic(copy, url, "revision", "--autogenerate", "--rev-id", "9999", "-m", "probe")
    (written,) = (copy / "migrations" / "versions").glob("9999_*.py")
    return written


def test_autogenerate_from_the_command_line_sees_every_table(tmp_path: Path) -> None:
    """At head, the command extending.md gives writes an empty revision: a table module env.py
    did not import would come out as a ``drop_table`` (it did, for the inbox)."""
    copy, url = command_line_copy(tmp_path, drop_head=False)
    upgrade = autogenerate(copy, url).read_text().split("def upgrade() -> None:", 1)[1]
    upgrade = upgrade.split("def downgrade() -> None:", 1)[0]
    assert "op." not in upgrade, upgrade


def test_an_autogenerated_revision_is_lint_clean(tmp_path: Path) -> None:
    """Alembic's post-write hooks run ruff on a new revision: ``make lint`` accepts it as written."""
    copy, url = command_line_copy(tmp_path, drop_head=True)
    written = autogenerate(copy, url)
    assert "op." in written.read_text()  # there was something to write
    ruff = [sys.executable, "-m", "ruff"]
    for check in (["check", "--no-fix"], ["format", "--check"]):
        result = subprocess.run(
            [*ruff, *check, "--config", "pyproject.toml", str(written.relative_to(copy))],
            cwd=copy,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 0, result.stdout + result.stderr
