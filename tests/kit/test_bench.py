"""``make bench`` works: the kit's benchmark (``python -m outbox_kit.testing.bench``) runs its
write-path and idle sections end to end on a fresh PostgreSQL database, with a worker child
process, and reports every figure it was asked for. What the figures are is docs/performance.md's
business; a test only proves that they are measured (no timing is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from outbox_kit.testing.fixtures import SERVICE_URLS, create_postgres_database, drop_postgres_database

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.postgres, pytest.mark.rabbitmq]


def test_the_benchmark_measures_the_write_path_and_an_idle_worker(tmp_path: Path) -> None:
    database = create_postgres_database()
    try:
        ran = subprocess.run(
            [
                *(sys.executable, "-m", "outbox_kit.testing.bench", "--only", "write,idle", "--rounds", "1"),
                *("--write-seconds", "1", "--idle-seconds", "2", "--database", database),
                *("--broker-url", SERVICE_URLS["rabbitmq"], "--json", "out.json", "--markdown", "out.md"),
            ],
            cwd=tmp_path,  # no alembic.ini there: the bench creates the kit's tables itself
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    finally:
        drop_postgres_database(database)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    report = json.loads((tmp_path / "out.json").read_text())
    figures = {figure["label"]: figure for figure in report["figures"]}
    assert set(figures) == {
        "Write, outbox on / off, 1 writer(s)",
        "Write, outbox on / off, 8 writer(s)",
        "Idle statements per second, 1 worker, default settings",
    }
    for label, figure in figures.items():
        assert figure["errors"] == [], f"{label}: {figure['errors']}"
        assert len(figure["values"]) == 1, f"{label}: not measured"
    assert "| Write, outbox on / off, 1 writer(s) |" in (tmp_path / "out.md").read_text()
