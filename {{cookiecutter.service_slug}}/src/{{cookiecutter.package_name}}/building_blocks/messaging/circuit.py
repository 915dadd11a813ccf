"""A circuit breaker around the broker publish.

After ``failure_threshold`` consecutive failures the circuit opens for ``reset_seconds``: the
processor then releases integration rows without charging a retry (a broker outage must not
dead-letter messages that never had a chance; the ADR records this as an omission, fixed here).
After the pause one trial publish is let through (half-open): success closes the circuit, failure
opens it again.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import TypeVar

from ..clock import Clock
from ..polling.source import CircuitOpenError

T = TypeVar("T")


class CircuitBreaker:
    """Consecutive-failure breaker with a half-open trial."""

    def __init__(self, *, failure_threshold: int, reset_seconds: float, clock: Clock) -> None:
        self._threshold = failure_threshold
        self._reset = timedelta(seconds=reset_seconds)
        self._clock = clock
        self._failures = 0
        self._open_until: datetime | None = None
        self._trial_running = False

    @property
    def state(self) -> str:
        if self._open_until is None:
            return "closed"
        return "open" if self._clock() < self._open_until else "half-open"

    async def call(self, operation: Callable[[], Awaitable[T]]) -> T:
        state = self.state
        if state == "open" or (state == "half-open" and self._trial_running):
            assert self._open_until is not None  # noqa: S101 (set whenever not closed)
            raise CircuitOpenError(max(self._open_until, self._clock() + timedelta(seconds=1)))
        self._trial_running = state == "half-open"
        try:
            result = await operation()
        except Exception:
            self._failures += 1
            if self._failures >= self._threshold or state == "half-open":
                self._open_until = self._clock() + self._reset
            raise
        finally:
            self._trial_running = False
        self._failures = 0
        self._open_until = None
        return result
