"""How a failed attempt is charged: the next retry count and, when it is the last, the reason.

* any failure: ``retry_count + 1``; at ``max_retries`` the row is dead-lettered
  ``retries_exhausted``;
* a name no class answers to, or a payload that no longer fits its class: the first miss may be
  a module still loading (a rolling deploy), so it is retried once; a second miss in a row is
  terminal (``type_unresolvable`` / ``malformed_payload``). Earlier failures of another kind do
  not count as a miss, nor does a miss before a replay (a replay keeps ``last_error`` but resets
  ``retry_count``). ``max_retries=1`` means no retry at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from ..application.registry import MalformedPayloadError, UnknownMessageError
from .claimed import ClaimedRow
from .retries import MALFORMED_PAYLOAD, RETRIES_EXHAUSTED, TYPE_UNRESOLVABLE


@dataclass(frozen=True)
class Failure:
    """A failed attempt, as it is recorded on its row."""

    attempt: int
    reason: str | None  # the dead-letter reason, when the row is finished with
    message: str
    retry_at: datetime


def classify(row: ClaimedRow, error: BaseException, max_retries: int) -> tuple[int, str | None]:
    """The new retry count and, when the row is finished with, its dead-letter reason."""
    attempt = row.retry_count + 1
    if isinstance(error, UnknownMessageError | MalformedPayloadError):
        reason = TYPE_UNRESOLVABLE if isinstance(error, UnknownMessageError) else MALFORMED_PAYLOAD
        missed = (row.last_error or "").startswith(f"{type(error).__name__}:")
        missed_before = missed and row.retry_count > 0
        return attempt, reason if missed_before or attempt >= max_retries else None
    return attempt, RETRIES_EXHAUSTED if attempt >= max_retries else None
