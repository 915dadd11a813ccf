"""The log formatters: readable lines by default (control characters escaped, traceback lines
indented, so a value from outside cannot forge a record), JSON lines with LOGGING__JSON_FORMAT;
both carry the correlation id and tenant."""

from __future__ import annotations

import json
import logging

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
        return True


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
