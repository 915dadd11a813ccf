"""The reliability tier's summary: one table of every conformance scenario that ran, printed at
the end of the run and written to ``reliability-report.md`` (or ``RELIABILITY_REPORT``)."""

from __future__ import annotations

import os
import platform
from datetime import UTC, datetime
from pathlib import Path

import pytest

from .conformance import PROJECT, REPORT

COLUMNS = (
    ("scenario", "scenario"),
    ("transport", "transport"),
    ("events", "events"),
    ("lost", "lost"),
    ("duplicated_effects", "duplicated effects"),
    ("wrong_context", "wrong context"),
    ("broker_redeliveries", "broker redeliveries"),
    ("seconds", "time (s)"),
    ("notes", "notes"),
)


def summary_table() -> str:
    lines = [
        "| " + " | ".join(title for _, title in COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    lines += ["| " + " | ".join(str(row[key]) for key, _ in COLUMNS) + " |" for row in REPORT]
    return "\n".join(lines)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not REPORT:
        return
    table = summary_table()
    heading = (
        f"Reliability scenarios, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, "
        f"{platform.node() or 'this machine'} ({os.cpu_count()} CPUs), Python {platform.python_version()}"
    )
    path = Path(os.environ.get("RELIABILITY_REPORT", PROJECT / "reliability-report.md"))
    path.write_text(f"{heading}\n\n{table}\n", encoding="utf-8")
    terminalreporter.write_sep("=", "reliability summary")
    terminalreporter.write_line(table)
    terminalreporter.write_line(f"(written to {path})")
