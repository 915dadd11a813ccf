"""``make bench`` works: the kit's benchmark (``python -m outbox_kit.testing.bench``) runs its
drain, end-to-end, write-path and idle sections end to end on a fresh PostgreSQL database and
RabbitMQ, with worker, counter and consumer child processes, and reports every figure it was
asked for, the CPU time per row, message and commit among them. What the figures are is docs/performance.md's
business; a test only proves that they are measured (no timing is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from outbox_kit.testing.fixtures import SERVICE_URLS, create_postgres_database, drop_postgres_database

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.postgres, pytest.mark.rabbitmq]


def test_the_benchmark_measures_the_relay_the_consumer_the_writer_and_an_idle_worker(tmp_path: Path) -> None:
    database = create_postgres_database()
    try:
        ran = subprocess.run(
            [
                *(sys.executable, "-m", "outbox_kit.testing.bench", "--only", "drain,e2e,write,idle"),
                *("--rounds", "1", "--messages", "300", "--no-nats"),
                *("--write-seconds", "1", "--idle-seconds", "2", "--database", database),
                *("--broker-url", SERVICE_URLS["rabbitmq"], "--json", "out.json", "--markdown", "out.md"),
            ],
            cwd=tmp_path,  # no alembic.ini there: the bench creates the kit's tables itself
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
    finally:
        drop_postgres_database(database)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    report = json.loads((tmp_path / "out.json").read_text())
    figures = {figure["label"]: figure for figure in report["figures"]}
    assert set(figures) == {
        "Relay drain, 1 worker / raw publish",
        "Relay drain, 2 workers / raw publish",
        "Relay CPU per row, 1 worker",
        "Relay CPU per row, 2 workers (both)",
        "Raw publish CPU per message (FastStream)",
        "End to end (consume pipeline, inbox) / raw publish",
        "Consumer CPU per message (pipeline, inbox)",
        "Writer CPU per commit of one event, outbox on",
        "Writer CPU per commit of one event, outbox off",
        "Outbox cost per commit of one event (on minus off)",
        "Write, outbox on / off, 1 writer(s), one event",
        "Write, outbox on / off, 8 writer(s), one event",
        "Writer CPU per commit of 3 keyed events, outbox on",
        "Writer CPU per commit of 3 keyed events, outbox off",
        "Outbox cost per commit of 3 keyed events (on minus off)",
        "Write, outbox on / off, 1 writer(s), 3 keyed events",
        "Idle statements per second, 1 worker, default settings",
    }
    for label, figure in figures.items():
        assert figure["errors"] == [], f"{label}: {figure['errors']}"
        assert len(figure["values"]) == 1, f"{label}: not measured"
        assert figure["values"][0] is not None, f"{label}: not measured"
        # An idle worker may well say nothing in two seconds; a difference of two short runs'
        # CPU times may come out either way.
        if figure["unit"] != "stmt/s" and "on minus off" not in label:
            assert figure["values"][0] > 0, f"{label}: {figure['values']}"
    assert "| Write, outbox on / off, 1 writer(s), one event |" in (tmp_path / "out.md").read_text()
