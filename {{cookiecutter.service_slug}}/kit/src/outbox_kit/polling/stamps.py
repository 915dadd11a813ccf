"""Processed stamps written together: one token-guarded UPDATE for every row that finished while
the previous one was in flight (a group commit).

Why: a stamp of its own per row is a transaction per message, and at the broker's pace those
round trips, not the publishes, were the relay's limit. A group collects for ``LINGER_SECONDS``
(5 ms) after its first stamp, and the rows that finish while a flush runs go together in the
next one. Measured on PostgreSQL + RabbitMQ with 64 publishes in flight: without the linger a
flush took about 5 rows; with it, about 30. The linger delays the *stamp* only, never the
publish (the consumer's latency does not include it).

What it keeps: a row is only handed in after its broker confirm, and each caller learns whether
*its* row was still its own (``RETURNING id``), exactly as with a single stamp; rows of different
claims (tokens) share the transaction but each is matched against its own token. A failed flush
fails every stamp of the group, and each of those rows is then treated as the single stamp's
failure was: it comes back when its lease ends and is published again (consumers dedupe).
A flush the database dropped (a connection terminated, a failover) is tried again on a fresh
connection, twice, after 0.1 s and 0.5 s: the statement is token-guarded, so a second attempt
cannot stamp a row that is no longer ours, and a row the dropped attempt did write (stamped at
the same ``now``) is still reported as ours. Without it, one dropped connection would leave a
whole group of confirmed rows to be published again when their leases end.
The flush runs as its own task, so a caller cancelled at shutdown does not cancel the stamps of
its group-mates (its own row stays in the group and is still written). The cycle's shutdown
gives that task the rest of its deadline (``settle``) and then cancels it, so no write outlives
the cycle and no connection is held past it.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import defaultdict
from datetime import datetime

from ..kernel.clock import Clock
from ..persistence.database import Database
from ..persistence.outages import is_database_outage
from .leases import LeaseStore

log = logging.getLogger(__name__)
LINGER_SECONDS = 0.005
RETRY_DELAYS_SECONDS = (0.1, 0.5)


class StampGroups:
    """Coalesces the processed stamps of one polled table."""

    def __init__(self, *, database: Database, leases: LeaseStore, clock: Clock) -> None:
        self._db = database
        self._leases = leases
        self._clock = clock
        # SQLite delivers one row at a time: there is nothing to gather, so no linger there.
        self._linger = LINGER_SECONDS if database.is_postgresql else 0.0
        self._waiting: dict[uuid.UUID, tuple[uuid.UUID, asyncio.Future[bool]]] = {}
        self._flushing: asyncio.Task[None] | None = None
        self.statements = 0  # how many UPDATEs the stamps took (the tests read the coalescing)

    async def stamp(self, row_id: uuid.UUID, token: uuid.UUID) -> bool:
        """Stamp ``row_id`` processed if it still carries ``token``; True when it did."""
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiting[row_id] = (token, future)
        if self._flushing is None:
            self._flushing = asyncio.create_task(self._flush_all(), name="stamp-groups")
        # Not shielded: a cancelled caller cancels only its future, which the flush then skips.
        return await future

    @property
    def flushing(self) -> bool:
        """True while a flush task runs (none may outlive a cancelled cycle)."""
        return self._flushing is not None

    async def settle(self, deadline: float) -> None:
        """Let a running flush finish until ``deadline`` (the loop's clock), then cancel it.

        Called when a cycle is cancelled, after its deliveries stopped: the stamps already handed
        in are written if the database answers in time; any left are simply not stamped, and
        their rows come back when their leases end.
        """
        flushing = self._flushing
        if flushing is None:
            return
        timeout = max(0.0, deadline - asyncio.get_running_loop().time())
        await asyncio.wait([flushing], timeout=timeout)
        flushing.cancel()
        await asyncio.wait([flushing])  # wait, not await: our own cancellation must not be lost

    async def _flush_all(self) -> None:
        try:
            await asyncio.sleep(self._linger)
            while self._waiting:
                group, self._waiting = self._waiting, {}
                await self._flush(group)
        finally:
            self._flushing = None
            group, self._waiting = self._waiting, {}
            for _token, future in group.values():  # only left when the flush was cancelled
                future.cancel()

    async def _flush(self, group: dict[uuid.UUID, tuple[uuid.UUID, asyncio.Future[bool]]]) -> None:
        by_token: defaultdict[uuid.UUID, list[uuid.UUID]] = defaultdict(list)
        for row_id, (token, _future) in group.items():
            by_token[token].append(row_id)
        try:
            ours = await self._write(by_token)
        except asyncio.CancelledError:
            for _token, future in group.values():
                future.cancel()
            raise
        except Exception as error:  # noqa: BLE001 (every caller of the group gets the failure)
            for _token, future in group.values():
                if not future.done():
                    future.set_exception(error)
            return
        for row_id, (_token, future) in group.items():
            if not future.done():
                future.set_result(row_id in ours)

    async def _write(self, by_token: dict[uuid.UUID, list[uuid.UUID]]) -> set[uuid.UUID]:
        now = self._clock()
        dropped = False
        for delay in RETRY_DELAYS_SECONDS:
            try:
                return await self._write_once(by_token, now, after_a_drop=dropped)
            except Exception as error:
                if not is_database_outage(error):
                    raise
                log.warning("processed stamps not written (%s); trying again in %.1f s", error, delay)
            dropped = True
            await asyncio.sleep(delay)
        return await self._write_once(by_token, now, after_a_drop=True)

    async def _write_once(
        self, by_token: dict[uuid.UUID, list[uuid.UUID]], now: datetime, *, after_a_drop: bool
    ) -> set[uuid.UUID]:
        ours: set[uuid.UUID] = set()
        async with self._db.bookkeeping_statement() as connection:
            for token, ids in by_token.items():
                self.statements += 1
                ours |= await self._leases.stamp_processed(connection, ids, token, now)
            missing = {row_id for ids in by_token.values() for row_id in ids} - ours
            if after_a_drop and missing:  # written by the attempt whose answer was lost?
                ours |= await self._leases.stamped_at(connection, missing, now)
        return ours
