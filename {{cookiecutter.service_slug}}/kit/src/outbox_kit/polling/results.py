"""How a delivery ended, as the polling core sees it: delivered (stamped already, or needing the
stamp), or paused because its downstream is known to be down. A pause is not the row's fault:
the row is released until ``retry_at`` without being charged a retry."""

from __future__ import annotations

from datetime import datetime
from enum import Enum


class Delivered(Enum):
    """How a successful delivery left the row."""

    NEEDS_STAMP = "needs_stamp"  # e.g. a broker confirmed the publish
    STAMPED = "stamped"  # the handler's unit of work stamped it in its own transaction


class PausedError(RuntimeError):
    """Not the row's fault: its downstream is down. Released until ``retry_at``, uncharged."""

    def __init__(self, message: str, retry_at: datetime) -> None:
        super().__init__(message)
        self.retry_at = retry_at
