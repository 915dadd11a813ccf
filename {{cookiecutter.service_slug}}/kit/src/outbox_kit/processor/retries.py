"""The retry rule: what one failed delivery attempt does to its row.

* any failure charges the row one attempt (``retry_count + 1``); at ``OUTBOX__MAX_RETRIES`` the
  row is dead-lettered ``retries_exhausted`` (``max_retries=1`` means no retry at all);
* a name no class answers to, or a payload that no longer fits its class: the first miss may be
  a module still loading (a rolling deploy), so it is retried once; a second miss in a row is
  terminal (``type_unresolvable`` / ``malformed_payload``). Earlier failures of another kind do
  not count as a miss, nor does a miss before a replay (a replay keeps ``last_error`` but resets
  ``retry_count``);
* a row that will be retried stays leased until its backoff ends (so its key stays blocked):
  ``OUTBOX__RETRY_BACKOFF_BASE_SECONDS * 2^(attempt-1) * U(0.8, 1.2)``, the jitter applied
  before the cap, the lease (so a capped wait lands exactly on the lease, and one outage's
  failures do not retry in step).

What is not charged (a paused downstream, a database outage, a lost lease) never reaches this
rule: ``processor.outcomes`` decides that, and writes what this rule gives."""

from __future__ import annotations

import random
from dataclasses import dataclass

from outbox_kit.application.messages import MalformedPayloadError, UnknownMessageError
from outbox_kit.persistence.tables import MALFORMED_PAYLOAD, RETRIES_EXHAUSTED, TYPE_UNRESOLVABLE
from outbox_kit.processor.claim import ClaimedRow


def backoff_seconds(attempt: int, *, base: float, cap: float, rng: random.Random) -> float:
    """``base * 2^(attempt-1) * U(0.8, 1.2)``, jitter applied before the cap."""
    exponent = min(max(attempt, 1) - 1, 62)
    return min(base * (2.0**exponent) * rng.uniform(0.8, 1.2), cap)


@dataclass(frozen=True)
class Charge:
    """One failed attempt, charged: the row's new retry count, and either the dead-letter
    reason (finished with) or the seconds until it is retried."""

    attempt: int
    dead_letter_reason: str | None
    retry_in_seconds: float


@dataclass(frozen=True)
class RetryRule:
    """The rule for one polled table, from its settings (see the module)."""

    max_retries: int
    backoff_base_seconds: float
    lease_seconds: float
    rng: random.Random

    def charge(self, row: ClaimedRow, error: BaseException) -> Charge:
        attempt = row.retry_count + 1
        reason = RETRIES_EXHAUSTED if attempt >= self.max_retries else None
        if isinstance(error, UnknownMessageError | MalformedPayloadError):
            missed = (row.last_error or "").startswith(f"{type(error).__name__}:")
            if (missed and row.retry_count > 0) or attempt >= self.max_retries:
                reason = TYPE_UNRESOLVABLE if isinstance(error, UnknownMessageError) else MALFORMED_PAYLOAD
        if reason is not None:
            return Charge(attempt, reason, 0.0)
        delay = backoff_seconds(attempt, base=self.backoff_base_seconds, cap=self.lease_seconds, rng=self.rng)
        return Charge(attempt, None, delay)
