"""Leases on the relay rows: token-guarded outcome writes, and the retry policy they record.

Why a row left the pending pool, and how long a failed one waits: the dead-letter reasons, the
paused marker, and the jittered exponential backoff (jitter before the cap).

Token-guarded writes on a polled table (``outbox_messages`` or ``internal_commands``).

Every outcome is guarded on the row id and the lock token *only* (no ``locked_until`` term): an
expired lease still lands while no other replica has claimed the row, and a row another replica
re-claimed under a new token is never overwritten. The one exception is the release of a claim
a stop interrupted (``release_claimed``): its ids are unknown, and the claim's own lease end,
which nothing has moved yet, lets an index find its rows. ``RETURNING id`` says which rows were still
ours: rowcount is not reliable across drivers (-1 for executemany on asyncpg and for ``WITH``
statements on SQLite)."""

from __future__ import annotations

import random
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from outbox_kit.application.text import storable

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


class LeaseLostError(RuntimeError):
    """The row no longer carries our token: another processor owns it now."""


@dataclass(frozen=True)
class FailureOutcome:
    """What a failure did to the row."""

    dead_lettered: bool
    retry_count: int
    retry_at: datetime | None


class LeaseStore:
    """The guarded writes for one polled table."""

    def __init__(self, table: sa.Table) -> None:
        self.table = table
        self._c = table.c

    def _ours(self, ids: Collection[uuid.UUID], token: uuid.UUID) -> sa.ColumnElement[bool]:
        return sa.and_(self._c.id.in_(list(ids)), self._c.lock_token == token)

    async def stamp_processed(
        self, connection: AsyncConnection, ids: Collection[uuid.UUID], token: uuid.UUID, now: datetime
    ) -> set[uuid.UUID]:
        """Mark rows delivered; return the ids that were still ours."""
        statement = (
            sa.update(self.table)
            .where(self._ours(ids, token))
            .values(processed_on=now, locked_until=None, lock_token=None)
            .returning(self._c.id)
        )
        result = await connection.execute(statement)
        return {row[0] for row in result}

    async def stamped_at(
        self, connection: AsyncConnection, ids: Collection[uuid.UUID], now: datetime
    ) -> set[uuid.UUID]:
        """The rows of ``ids`` stamped processed at exactly ``now``: an earlier attempt of the same
        stamp that was written although its connection dropped before the answer came back."""
        statement = sa.select(self._c.id).where(self._c.id.in_(list(ids)), self._c.processed_on == now)
        return {row[0] for row in await connection.execute(statement)}

    async def release(
        self,
        connection: AsyncConnection,
        ids: Collection[uuid.UUID],
        token: uuid.UUID,
        *,
        error: str | None = None,
        until: datetime | None = None,
    ) -> set[uuid.UUID]:
        """Give rows back without charging a retry (failed in-process attempt, shutdown, open
        circuit). ``until`` keeps them unclaimable for a while (the key stays blocked)."""
        values: dict[str, object] = {"locked_until": until, "lock_token": None, "locked_by": None}
        if error is not None:
            values["last_error"] = storable(error, MAX_ERROR_LENGTH)
        return await self._give_back(connection, self._ours(ids, token), values)

    async def release_claimed(
        self, connection: AsyncConnection, token: uuid.UUID, lease_until: datetime
    ) -> set[uuid.UUID]:
        """Give back, uncharged, every row a claim leased under ``token`` until ``lease_until``
        (a claim whose answer may never have arrived, so its ids are unknown).

        No index covers ``lock_token``: the claim's ``locked_until`` and the pending predicate
        let the pending/locked partial index find the rows, not a scan of the table's history.
        """
        c = self._c
        ours = sa.and_(
            c.lock_token == token,
            c.locked_until == lease_until,
            c.processed_on.is_(None),
            c.dead_lettered_on.is_(None),
        )
        values: dict[str, object] = {"locked_until": None, "lock_token": None, "locked_by": None}
        return await self._give_back(connection, ours, values)

    async def _give_back(
        self, connection: AsyncConnection, ours: sa.ColumnElement[bool], values: dict[str, object]
    ) -> set[uuid.UUID]:
        statement = sa.update(self.table).where(ours).values(**values).returning(self._c.id)
        result = await connection.execute(statement)
        return {row[0] for row in result}

    async def renew(
        self, connection: AsyncConnection, row_id: uuid.UUID, token: uuid.UUID, until: datetime
    ) -> bool:
        """Extend the lease just before dispatch; False means the row is no longer ours."""
        statement = (
            sa.update(self.table)
            .where(
                self._c.id == row_id,
                self._c.lock_token == token,
                self._c.processed_on.is_(None),
                self._c.dead_lettered_on.is_(None),
            )
            .values(locked_until=until)
            .returning(self._c.id)
        )
        result = await connection.execute(statement)
        return result.first() is not None

    async def record_failure(
        self,
        connection: AsyncConnection,
        row_id: uuid.UUID,
        token: uuid.UUID,
        *,
        now: datetime,
        error: str,
        retry_count: int,
        retry_at: datetime,
        dead_letter_reason: str | None,
    ) -> bool:
        """Charge one retry: re-lease for the backoff, or dead-letter with ``reason``."""
        values: dict[str, object] = {
            "retry_count": retry_count,
            "last_error": storable(error, MAX_ERROR_LENGTH),
            "lock_token": None,
            "locked_by": None,
        }
        if dead_letter_reason is None:
            # The row stays leased until the backoff ends, so its key stays blocked meanwhile.
            values["locked_until"] = retry_at
        else:
            values |= {
                "locked_until": None,
                "dead_lettered_on": now,
                "dead_letter_reason": dead_letter_reason,
            }
        statement = (
            sa.update(self.table)
            .where(self._c.id == row_id, self._c.lock_token == token)
            .values(**values)
            .returning(self._c.id)
        )
        result = await connection.execute(statement)
        return result.first() is not None


def lease_until(now: datetime, lease_seconds: float) -> datetime:
    return now + timedelta(seconds=lease_seconds)
