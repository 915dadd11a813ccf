"""Time: the clock every part reads, and the time limit every delivery runs under.

Time is a dependency (:data:`Clock`), so tests can move it and the code never calls
``datetime.now`` ad hoc.

The time limit of one delivery (a processor's row, an after-commit dispatch, a consumer's
handler run). Without one, a handler that never returns holds its row or message for ever, and
with it the cycle, the partition or the consumer that waits for it. Past the limit the work is
cancelled and fails with :class:`TimeLimitExceededError`: a failure like any other, charged,
retried with backoff and dead-lettered at the attempt limit, its text ("delivery timed out after
60 s") in ``last_error`` or ``x-error``. One ``asyncio.timeout`` per delivery: no extra task.

A limit only helps where the work yields: a handler that blocks the event loop (CPU, a
synchronous call) cannot be interrupted by it. How the limits nest inside the lease is
``runtime.time_limits``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from datetime import UTC, datetime

Clock = Callable[[], datetime]


def system_clock() -> datetime:
    """The current time, timezone-aware in UTC."""
    return datetime.now(UTC)


# A delivery's limit as its runner hands it down (``time_limit`` with the seconds and the name
# bound): the deliverer puts it around the handlers or the publish only, not around the commit
# that stamps the row and delivers what the handlers raised (each of those has its own).
TimeLimit = Callable[[], AbstractAsyncContextManager[None]]


class TimeLimitExceededError(TimeoutError):
    """The work ran past its time limit and was cancelled."""


@asynccontextmanager
async def time_limit(seconds: float, what: str) -> AsyncIterator[None]:
    """Cancel the block after ``seconds`` and raise :class:`TimeLimitExceededError` naming
    ``what``; a ``TimeoutError`` the block raised itself (a publish timeout) passes unchanged."""
    limit = asyncio.timeout(seconds)
    try:
        async with limit:
            yield
    except TimeoutError as error:
        if not limit.expired():
            raise
        msg = f"{what} timed out after {seconds:g} s"
        raise TimeLimitExceededError(msg) from error
