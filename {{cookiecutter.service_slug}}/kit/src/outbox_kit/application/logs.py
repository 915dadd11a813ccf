"""Logs: readable lines by default (control characters escaped, traceback lines indented, so a
value from outside cannot forge a record), JSON lines with LOGGING__JSON_FORMAT; both carry the
correlation id and tenant.
"""

from __future__ import annotations

import json
import logging
import sys

from outbox_kit.application.context import current_context
from outbox_kit.application.text import escape_controls


def _exception_text(formatter: logging.Formatter, record: logging.LogRecord) -> str | None:
    """The record's traceback, formatted once and cached on the record as ``logging`` does, so
    what a filter made of it (credentials masked) is what gets written."""
    if record.exc_info and not record.exc_text:
        record.exc_text = formatter.formatException(record.exc_info)
    return record.exc_text or None


class ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        context = current_context()
        record.correlation_id = context.correlation_id
        record.tenant_id = context.tenant_id or "-"
        record.trace_id, record.span_id = _active_span_ids()
        return True


def _active_span_ids() -> tuple[str | None, str | None]:
    """The trace and span ids of the OpenTelemetry span open where the record was made, so a log
    line leads to its trace. Read only when OpenTelemetry is loaded (tracing on); a record made
    outside any span has none."""
    trace = sys.modules.get("opentelemetry.trace")
    if trace is None:
        return None, None
    span = trace.get_current_span().get_span_context()
    if not span.is_valid:
        return None, None
    return f"{span.trace_id:032x}", f"{span.span_id:016x}"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "correlation_id": getattr(record, "correlation_id", None),
            "tenant_id": getattr(record, "tenant_id", None),
        }
        if trace_id := getattr(record, "trace_id", None):
            entry["trace_id"], entry["span_id"] = trace_id, getattr(record, "span_id", None)
        if exception := _exception_text(self, record):
            entry["exception"] = exception
        return json.dumps(entry)


TEXT_FORMAT = "%(asctime)s %(levelname)-7s %(name)s [%(correlation_id)s] %(message)s"

CONTINUATION = "    "  # a traceback line never starts like a record (records start with the time)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        record.message = record.getMessage()
        record.asctime = self.formatTime(record, self.datefmt)
        details = []
        if exception := _exception_text(self, record):
            details.append(exception)
        if record.stack_info:
            details.append(self.formatStack(record.stack_info))
        continued = [CONTINUATION + escape_controls(line) for text in details for line in text.splitlines()]
        return "\n".join([escape_controls(self.formatMessage(record)), *continued])
