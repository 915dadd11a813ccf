"""Process-wide logging: readable lines by default, JSON lines with ``LOGGING__JSON_FORMAT``.

The service logs values from outside (message ids, header values, error texts of rejected
messages), so a record must not be able to forge another: in the text format every record is
one line starting with its time, the rendered line has its control characters escaped (a
newline in a message id cannot start a forged record, an ESC cannot repaint a terminal, a lone
surrogate cannot break the write), and the lines of a traceback or stack follow it indented.
Escaping here, once, covers every log call. The JSON format needs nothing more: ``json.dumps``
escapes control characters and surrogates inside each value. In both formats a URL's password is
masked, in the message and in the traceback (``building_blocks.redaction``).
"""

from __future__ import annotations

import json
import logging
import sys

from ..building_blocks.kernel.redaction import CredentialMaskingFilter
from ..building_blocks.kernel.request_context import current_context
from ..building_blocks.kernel.text import escape_controls
from ..settings import LoggingSettings


def _exception_text(formatter: logging.Formatter, record: logging.LogRecord) -> str | None:
    """The record's traceback, formatted once and cached on the record as ``logging`` does, so
    what a filter made of it (credentials masked) is what gets written."""
    if record.exc_info and not record.exc_text:
        record.exc_text = formatter.formatException(record.exc_info)
    return record.exc_text or None


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        context = current_context()
        record.correlation_id = context.correlation_id
        record.tenant_id = context.tenant_id or "-"
        return True


class _JsonFormatter(logging.Formatter):
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


class _TextFormatter(logging.Formatter):
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


def configure_logging(settings: LoggingSettings) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_ContextFilter())
    handler.addFilter(CredentialMaskingFilter())  # after the context: it reads the final message
    handler.setFormatter(_JsonFormatter() if settings.json_format else _TextFormatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.level.upper())
