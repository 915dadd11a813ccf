"""Process-wide logging: readable lines by default, JSON lines with ``LOGGING__JSON_FORMAT``."""

from __future__ import annotations

import json
import logging
import sys

from ..building_blocks.context import current_context
from ..settings import LoggingSettings


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
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(settings: LoggingSettings) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_ContextFilter())
    handler.setFormatter(
        _JsonFormatter()
        if settings.json_format
        else logging.Formatter("%(asctime)s %(levelname)-7s %(name)s [%(correlation_id)s] %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.level.upper())
