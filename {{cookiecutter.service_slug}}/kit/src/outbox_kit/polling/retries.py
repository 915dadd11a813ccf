"""Why a row left the pending pool, and how long a failed one waits: the dead-letter reasons, the
paused marker, and the jittered exponential backoff (jitter before the cap)."""

from __future__ import annotations

import random

MAX_ERROR_LENGTH = 4000

# ``last_error`` of a row released uncharged while its downstream is down (open circuit):
# ``explain`` reports it as paused, not as backing off after a failure of its own.
PAUSED_PREFIX = "paused, not charged: "

RETRIES_EXHAUSTED = "retries_exhausted"

TYPE_UNRESOLVABLE = "type_unresolvable"

MALFORMED_PAYLOAD = "malformed_payload"

CASCADE_DEPTH_EXCEEDED = "cascade_depth_exceeded"


def backoff_seconds(attempt: int, *, base: float, cap: float, rng: random.Random) -> float:
    """``base * 2^(attempt-1) * U(0.8, 1.2)``, jitter applied before the cap
    (so a capped wait lands exactly on the lease, and one outage's failures do not retry in step)."""
    exponent = min(max(attempt, 1) - 1, 62)
    return min(base * (2.0**exponent) * rng.uniform(0.8, 1.2), cap)
