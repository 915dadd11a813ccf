"""A broker outage is not the message's fault. A transport raises :class:`BrokerUnavailableError`
around its publish when it could not reach the broker; the circuit breaker answers an open
circuit with :class:`CircuitOpenError`, a pause that releases the row uncharged."""

from __future__ import annotations

from datetime import datetime

from ..polling.results import PausedError


class CircuitOpenError(PausedError):
    """The broker is known to be down; the row is released until ``retry_at``, uncharged."""

    def __init__(self, retry_at: datetime) -> None:
        super().__init__(f"circuit open until {retry_at.isoformat()}", retry_at)


class BrokerUnavailableError(ConnectionError):
    """The broker could not be reached (raised by transports around their publish)."""
