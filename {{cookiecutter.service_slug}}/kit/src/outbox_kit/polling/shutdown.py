"""What one cycle does when the process stops in the middle of it (a cancellation).

Nothing is charged. Deliveries already started run on and write their outcomes; rows the cycle
never reached are released at once, beside them (a delivery or write that hangs must not use up
the time their release needs); halfway to the deadline what still runs is cancelled and its rows
are released too, claimable again at once. Everything shares one deadline
(``OUTBOX__SHUTDOWN_TIMEOUT_SECONDS``), so the worker's wait of the shutdown timeout covers all a
cycle does. A stop during the claim itself gives back the whole batch (``claim``). Every
release is token-guarded: a row whose outcome was written no longer matches.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Collection, Sequence
from contextlib import suppress
from datetime import datetime
from typing import TypeVar

from sqlalchemy.ext.asyncio import AsyncConnection

from ..persistence.database import Database
from .claimed import ClaimedRow
from .leases import LeaseStore

log = logging.getLogger(__name__)
T = TypeVar("T")


class CycleShutdown:
    """One cycle's shutdown deadline and the writes it protects."""

    def __init__(self, *, name: str, timeout_seconds: float, database: Database, leases: LeaseStore) -> None:
        self._name = name
        self._timeout = timeout_seconds
        self._db = database
        self._leases = leases
        self._deadline: float | None = None

    def deadline(self) -> float:
        """Set on the first use after the cancellation, then the same for everything."""
        if self._deadline is None:
            self._deadline = asyncio.get_running_loop().time() + self._timeout
        return self._deadline

    async def write(self, outcome: Awaitable[T]) -> T:
        """Write an outcome; if a cancellation interrupts, finish it within the deadline."""
        task = asyncio.ensure_future(outcome)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            try:
                async with asyncio.timeout_at(self.deadline()):
                    await task
            except Exception:
                log.exception("%s: an outcome write did not finish during shutdown", self._name)
            raise

    async def stop(
        self,
        tasks: Sequence[asyncio.Future[bool]],
        rows: Sequence[ClaimedRow],
        started: Collection[uuid.UUID],
        token: uuid.UUID,
    ) -> None:
        """Let the started deliveries finish within half the deadline while the unreached rows
        are released; then cancel what still runs and release those rows too.

        A publish is cut short only halfway to the deadline: cancelled at once, a message the broker
        already holds would be left unstamped and sent again by the next worker.
        """
        waiting = [task for task, row in zip(tasks, rows, strict=True) if row.id not in started]
        for task in waiting:  # not started: blocked on the concurrency gate, they never begin
            task.cancel()
        unreached = [row for row in rows if row.id not in started]
        # Half the time for the deliveries, so the release of what they leave still fits.
        await asyncio.gather(
            self.release(unreached, token), asyncio.wait(tasks, timeout=self._remaining() / 2)
        )
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.release([row for row in rows if row.id in started], token)

    async def claim(
        self, claim: Awaitable[list[ClaimedRow]], token: uuid.UUID, lease_until: datetime
    ) -> list[ClaimedRow]:
        """Run the cycle's claim, which leases to ``token`` until ``lease_until``; if a
        cancellation interrupts it, give back what it leased.

        The claim commits on its own, so a stop that lands after the server committed it (its
        answer on the way back, its connection returning to the pool) would leave the whole
        batch leased for a lease under a token nobody holds. The claim is let finish within half
        the deadline (it may be committing), then cancelled, and its cancellation is awaited
        within half of what is left: a COMMIT already sent lands when the server says so, and a
        release that read the table before it would miss the rows. Then every row still under
        the claim's token and lease end is released, uncharged: not by id, since a claim cut
        short may have committed unheard.
        """
        task = asyncio.ensure_future(claim)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            await asyncio.wait([task], timeout=self._remaining() / 2)
            task.cancel()  # no-op once it is done
            await asyncio.wait([task], timeout=self._remaining() / 2)  # the rest is the release's
            task.add_done_callback(_observed)
            await self._give_back(
                lambda connection: self._leases.release_claimed(connection, token, lease_until)
            )
            raise

    async def release(self, rows: Sequence[ClaimedRow], token: uuid.UUID) -> None:
        if rows:
            ids = [row.id for row in rows]
            await self._give_back(lambda connection: self._leases.release(connection, ids, token))

    async def _give_back(self, release: Callable[[AsyncConnection], Awaitable[object]]) -> None:
        """Best effort within the deadline: rows not released wait out their lease."""
        with suppress(Exception):
            async with asyncio.timeout_at(self.deadline()):
                async with self._db.bookkeeping() as connection:
                    await release(connection)

    def _remaining(self) -> float:
        return max(0.0, self.deadline() - asyncio.get_running_loop().time())


def _observed(task: asyncio.Future[list[ClaimedRow]]) -> None:
    """The cycle is ending either way: an error of its interrupted claim is not one to report."""
    if not task.cancelled():
        task.exception()
