"""The outcome of each row, written as soon as the row finishes, guarded by id and lock token.

* delivered: stamped processed (unless the handler's own transaction already did), together
  with the stamps of the rows that finished meanwhile (``stamps``);
* failed: ``retry_count + 1`` and ``last_error`` (see ``failures``); re-leased for the jittered
  backoff, or dead-lettered with an Error log naming the row;
* paused (the downstream or the database is down): released without charging a retry;
* lease lost (the token no longer matches): a Warning and a count, never an overwrite.

A database outage while recording is not charged to the row (the caller's cycle fails and the
row comes back when its lease ends). Any other refusal of a failure record cannot be waited out,
so it must not loop: the retry is charged with a plain reason instead of the failure's text.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import uuid
from datetime import datetime, timedelta

from ..kernel.clock import Clock
from ..kernel.text import describe
from ..persistence.database import Database
from ..persistence.outages import is_database_outage
from .claimed import ClaimedRow
from .failures import Failure, classify
from .leases import LeaseStore
from .ports import CycleMetrics, SourceSettings
from .retries import PAUSED_PREFIX, backoff_seconds
from .stamps import StampGroups

log = logging.getLogger(__name__)


class Outcomes:
    """The guarded writes of one source and what they report (metrics, logs)."""

    def __init__(
        self,
        *,
        name: str,
        settings: SourceSettings,
        database: Database,
        leases: LeaseStore,
        clock: Clock,
        metrics: CycleMetrics,
        rng: random.Random,
    ) -> None:
        self._name = name
        self._settings = settings
        self._db = database
        self._leases = leases
        self._clock = clock
        self._metrics = metrics
        self._rng = rng
        self.stamps = StampGroups(database=database, leases=leases, clock=clock)

    def lease_is_short(self, row: ClaimedRow) -> bool:
        """What is left of the lease (by this process's clock) might not outlast a delivery
        that runs to its time limit: time to renew."""
        left = (row.locked_until - self._clock()).total_seconds()
        return left < self._settings.renew_below_seconds

    async def renew(self, row: ClaimedRow, token: uuid.UUID) -> bool:
        """Push the lease to now + lease just before delivery; False when no longer ours."""
        until = self._clock() + timedelta(seconds=self._settings.lease_seconds)
        async with self._db.bookkeeping_statement() as connection:
            return await self._leases.renew(connection, row.id, token, until)

    async def stamp(self, row: ClaimedRow, token: uuid.UUID) -> bool:
        """True when the stamp landed; a lost lease is not this processor's progress."""
        stamped = await self.stamps.stamp(row.id, token)
        if stamped:
            self.delivered(row)
        else:
            self.lost(row, "after delivery (the new owner may deliver it again; consumers dedupe)")
        return bool(stamped)

    def delivered(self, row: ClaimedRow) -> None:
        lag = (self._clock() - row.occurred_on).total_seconds()
        self._metrics.delivered(self._name, row.kind or "command", max(lag, 0.0))

    async def pause(self, row: ClaimedRow, token: uuid.UUID, until: datetime | None, why: str) -> None:
        """Release the row uncharged (its downstream is down); ``explain`` reports it paused."""
        async with self._db.bookkeeping() as connection:
            await self._leases.release(
                connection, [row.id], token, until=until, error=f"{PAUSED_PREFIX}{why}"
            )

    async def fail(self, row: ClaimedRow, token: uuid.UUID, error: BaseException) -> None:
        """Charge one retry, or dead-letter the row when it is finished with."""
        attempt, reason = classify(row, error, self._settings.max_retries)
        delay = backoff_seconds(
            attempt,
            base=self._settings.retry_backoff_base_seconds,
            cap=self._settings.lease_seconds,
            rng=self._rng,
        )
        failure = Failure(attempt, reason, describe(error), self._clock() + timedelta(seconds=delay))
        if not await self._record(row, token, failure, error):
            self.lost(row, "while recording its failure")
            return
        self._metrics.failed(self._name)
        if reason is None:
            log.warning(
                "%s row %s (%s) failed attempt %s/%s, retrying in %.1fs: %s",
                *(self._name, row.id, row.name, attempt, self._settings.max_retries, delay, failure.message),
            )
            return
        self._metrics.dead_lettered(self._name, reason)
        log.error(
            "%s row %s (%s) dead-lettered (%s) after %s attempt(s): %s",
            *(self._name, row.id, row.name, reason, attempt, failure.message),
        )

    async def _record(
        self, row: ClaimedRow, token: uuid.UUID, failure: Failure, error: BaseException
    ) -> bool:
        try:
            return await self._write_failure(row, token, failure)
        except Exception as refused:
            if is_database_outage(refused):
                raise
            log.warning("%s row %s: its failure could not be recorded as is: %s", self._name, row.id, refused)
            unrecorded = type(refused).__name__
            plain = f"{type(error).__name__} (the failure's text could not be recorded: {unrecorded})"
            return await self._write_failure(row, token, dataclasses.replace(failure, message=plain))

    async def _write_failure(self, row: ClaimedRow, token: uuid.UUID, failure: Failure) -> bool:
        async with self._db.bookkeeping() as connection:
            return await self._leases.record_failure(
                connection,
                row.id,
                token,
                now=self._clock(),
                error=failure.message,
                retry_count=failure.attempt,
                retry_at=failure.retry_at,
                dead_letter_reason=failure.reason,
            )

    def lost(self, row: ClaimedRow, when: str) -> None:
        self._metrics.lost_lease(self._name)
        log.warning("%s row %s (%s): lease lost %s", self._name, row.id, row.name, when)
