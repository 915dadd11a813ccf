"""What the service logs from outside (message ids, header values, error texts) cannot forge a
log record: every record starts exactly one line that begins with its time."""

from __future__ import annotations

import io
import json
import logging
import re
import sys
from collections.abc import Callable, Iterator

import pytest
from outbox_kit.runtime.cli import configure_logging
from outbox_kit.runtime.settings import LoggingSettings

pytestmark = pytest.mark.unit
RECORD_START = re.compile(r"\d{4}-\d{2}-\d{2}")
FORGED = "\n2026-01-01 ERROR forged"
HOSTILE_ID = f"m-1{FORGED}\r\x00\x1b[31m\x85\u2028\udcff"

ServiceLog = Callable[[bool], io.StringIO]


@pytest.fixture
def service_log(monkeypatch: pytest.MonkeyPatch) -> Iterator[ServiceLog]:
    """The service's own logging set-up, writing to a buffer; the root logger restored after."""
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)

    def configure(json_format: bool) -> io.StringIO:
        stream = io.StringIO()
        monkeypatch.setattr(sys, "stderr", stream)
        configure_logging(LoggingSettings(level="INFO", json_format=json_format))
        return stream

    yield configure
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])


def reject_input() -> None:
    raise ValueError(f"bad input{FORGED}")


def log_hostile_records() -> None:
    log = logging.getLogger("tests.hostile")
    log.warning("consumer %s failed on %s", "kit.observer", HOSTILE_ID)
    try:
        reject_input()
    except ValueError:
        log.exception("message %s rejected", HOSTILE_ID)


def test_the_text_log_escapes_untrusted_values_and_indents_tracebacks(service_log: ServiceLog) -> None:
    output = service_log(False)
    log_hostile_records()
    lines = output.getvalue().splitlines()
    starts = [line for line in lines if RECORD_START.match(line)]
    assert len(starts) == 2, lines
    assert starts[0].endswith(r"failed on m-1\n2026-01-01 ERROR forged\r\x00\x1b[31m\x85\u2028\udcff")
    assert all(line.startswith(" ") for line in lines if line not in starts)  # traceback lines
    assert any(line.strip() == "2026-01-01 ERROR forged" for line in lines)  # kept, but indented
    assert not re.search("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]", output.getvalue())


def test_the_json_log_keeps_one_record_per_line_with_the_values_intact(service_log: ServiceLog) -> None:
    output = service_log(True)
    log_hostile_records()
    records = [json.loads(line) for line in output.getvalue().splitlines()]
    assert [record["message"] for record in records] == [
        f"consumer kit.observer failed on {HOSTILE_ID}",
        f"message {HOSTILE_ID} rejected",
    ]
    assert f"ValueError: bad input{FORGED}" in records[1]["exception"]
