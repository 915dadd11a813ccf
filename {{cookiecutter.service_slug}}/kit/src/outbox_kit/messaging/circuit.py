"""A circuit breaker around the broker publish, that never charges an outage to a message.

Only :class:`BrokerUnavailableError` (the transport said it could not reach the broker: a lost
connection, a timeout, no servers) counts. Such a failure is not the message's fault, so it is
never recorded as one of the row's retries: the row is released until the breaker may close
(charging outages would dead-letter healthy messages during any outage longer than the retries).
After ``failure_threshold`` consecutive outages the circuit opens for ``reset_seconds`` and no
publish is attempted; then one trial is let through (half-open): success closes it, an outage
opens it again. A message-level failure (an unroutable message, a consumer error on the
in-process bus) passes through unchanged and is retried and dead-lettered as usual; it also
proves the broker is reachable, so it closes a half-open circuit.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import TypeVar

from ..kernel.clock import Clock
from .outages import BrokerUnavailableError, CircuitOpenError

T = TypeVar("T")


class CircuitBreaker:
    """Consecutive-outage breaker with a half-open trial."""

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

    def _retry_at(self) -> datetime:
        now = self._clock()
        if self._open_until is not None and self._open_until > now:
            return self._open_until
        # Below the threshold: step back a little, growing with the streak of outages.
        return now + min(self._reset, timedelta(seconds=self._failures))

    async def call(self, operation: Callable[[], Awaitable[T]]) -> T:
        state = self.state
        if state == "open" or (state == "half-open" and self._trial_running):
            raise CircuitOpenError(self._retry_at())
        self._trial_running = state == "half-open"
        try:
            result = await operation()
        except BrokerUnavailableError as outage:
            self._failures += 1
            if self._failures >= self._threshold or state == "half-open":
                self._open_until = self._clock() + self._reset
            raise CircuitOpenError(self._retry_at()) from outage
        except Exception:
            self._close()  # the broker answered; this message is the problem
            raise
        finally:
            self._trial_running = False
        self._close()
        return result

    def _close(self) -> None:
        self._failures = 0
        self._open_until = None
