"""Time as a dependency, so tests can move it and the code never calls ``datetime.now`` ad hoc."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime

Clock = Callable[[], datetime]


def system_clock() -> datetime:
    """The current time, timezone-aware in UTC."""
    return datetime.now(UTC)
