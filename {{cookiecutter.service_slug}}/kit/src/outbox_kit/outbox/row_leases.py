"""The leases of rows a commit inserted already leased to this process, as in-process dispatch
keeps them: renewed just before each row's handlers run (a lost one raises ``LeaseLostError``),
and given back (uncharged) when the row cannot be delivered here, with a PostgreSQL NOTIFY in the
releasing transaction so a worker in another process retries it after the processing delay,
not at its fallback poll. A release is best effort: a failed one is logged and the rows wait out
their lease. At shutdown the release is protected from the cancellation and bounded by the
shutdown timeout."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from datetime import timedelta
from itertools import groupby

import sqlalchemy as sa

from ..persistence.tables import OUTBOX_TABLE
from ..polling.leases import LeaseLostError, LeaseStore
from ..polling.wake import wake_replicas
from ..unit_of_work.factory import UnitOfWorkFactory
from ..unit_of_work.rows import WrittenRow

log = logging.getLogger(__name__)


class InProcessRowLeases:
    """Renewals, releases and the key check of in-process outbox rows."""

    def __init__(
        self,
        *,
        units: Callable[[], UnitOfWorkFactory],
        lease_seconds: float,
        notify_channel: str,
        shutdown_timeout_seconds: float,
    ) -> None:
        self._units = units
        self._lease = timedelta(seconds=lease_seconds)
        self._channel = notify_channel
        self._shutdown_timeout = shutdown_timeout_seconds
        self.store = LeaseStore(OUTBOX_TABLE)

    async def renew(self, row: WrittenRow) -> None:
        """Give the row a whole lease for its own delivery (``LeaseLostError``: no longer ours)."""
        until = self._units().clock() + self._lease
        async with self._units().database.bookkeeping() as connection:
            if not await self.store.renew(connection, row.id, row.lock_token, until):
                msg = f"outbox row {row.id} is no longer leased to this process"
                raise LeaseLostError(msg)

    async def has_earlier_pending(self, row: WrittenRow) -> bool:
        table = OUTBOX_TABLE
        statement = (
            sa.select(sa.literal(1))
            .where(
                table.c.ordering_key == row.ordering_key,
                table.c.seq < row.seq,
                table.c.processed_on.is_(None),
                table.c.dead_lettered_on.is_(None),
            )
            .limit(1)
        )
        async with self._units().database.bookkeeping() as connection:
            result = await connection.execute(statement)
            return result.first() is not None

    async def release(self, rows: Sequence[WrittenRow], error: BaseException | None) -> None:
        """Give rows back to the processor (uncharged) and wake every replica's processor."""
        note = None if error is None else repr(error)
        try:
            async with self._units().database.bookkeeping() as connection:
                for token, group in groupby(rows, key=lambda row: row.lock_token):
                    await self.store.release(connection, [row.id for row in group], token, error=note)
                if self._units().database.is_postgresql:
                    await connection.execute(wake_replicas(self._channel))
            self._units().wake()
        except Exception:
            # Best effort: the rows then wait out their lease (OUTBOX__LEASE_SECONDS).
            log.exception("could not release the lease of %s outbox row(s)", len(rows))

    async def release_on_shutdown(self, rows: Sequence[WrittenRow]) -> None:
        """The release, protected from the cancellation that is stopping the process and bounded
        by the shutdown timeout."""
        release = asyncio.ensure_future(self.release(rows, None))
        try:
            await asyncio.wait_for(asyncio.shield(release), self._shutdown_timeout)
        except TimeoutError:
            log.warning(
                "shutdown: %s in-process row(s) not released in time; they wait out their lease", len(rows)
            )
