"""Process-wide logging: readable lines by default, JSON lines with ``LOGGING__JSON_FORMAT``.

The service logs values from outside (message ids, header values, error texts of rejected
messages), so a record must not be able to forge another: in the text format every record is
one line starting with its time, the rendered line has its control characters escaped (a
newline in a message id cannot start a forged record, an ESC cannot repaint a terminal, a lone
surrogate cannot break the write), and the lines of a traceback or stack follow it indented.
Escaping here, once, covers every log call. The JSON format needs nothing more: ``json.dumps``
escapes control characters and surrogates inside each value. In both formats a URL's password is
masked, in the message and in the traceback (``outbox_kit.application.text``).
"""

from __future__ import annotations

import logging
import sys

from outbox_kit.application.observability import TEXT_FORMAT, ContextFilter, JsonFormatter, TextFormatter
from outbox_kit.application.text import CredentialMaskingFilter

from ..settings import LoggingSettings


def configure_logging(settings: LoggingSettings) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(ContextFilter())
    handler.addFilter(CredentialMaskingFilter())  # after the context: it reads the final message
    handler.setFormatter(JsonFormatter() if settings.json_format else TextFormatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.level.upper())
