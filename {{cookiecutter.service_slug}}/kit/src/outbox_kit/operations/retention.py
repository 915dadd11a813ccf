"""Retention: delete delivered rows, dead letters and inbox records once they are old enough.

Processed rows go ``OUTBOX__RETENTION_DAYS`` (default 7; 0 disables) after they were processed,
dead letters ``OUTBOX__DEAD_LETTER_RETENTION_DAYS`` (0 = same as retention; set it longer to keep
evidence for diagnosis and replay) after they were dead-lettered, inbox rows
``INBOX__RETENTION_DAYS`` after they were received, idempotency keys
``API__IDEMPOTENCY_KEY_RETENTION_HOURS`` after they were first used. The clock starts at the row's
*last* state change, not at ``occurred_on``: a row replayed or delivered late keeps its full window
(keyed on ``occurred_on``, a week-old event delivered today would be deleted at the next sweep, and
a replayed dead letter that failed again would vanish before anyone read it). Deletion cannot be
undone, so every sweep that removed rows logs one Warning per table naming the counts. Deletes run
in bounded batches, each its own short transaction, through indexes that contain no pending row, so
the claim's hot path is never locked for long."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Self

import sqlalchemy as sa

from outbox_kit.application.clock import Clock
from outbox_kit.application.metrics import RelayMetrics
from outbox_kit.persistence.database import Database
from outbox_kit.persistence.tables import IDEMPOTENCY_KEYS_TABLE, INBOX_TABLE, POLLED_TABLES
from outbox_kit.processor.settings import InboxSettings, OutboxSettings

log = logging.getLogger(__name__)
INBOX = INBOX_TABLE
KEYS = IDEMPOTENCY_KEYS_TABLE


@dataclass(frozen=True)
class RetentionPolicy:
    retention_days: int
    dead_letter_days: int  # resolved: OUTBOX__DEAD_LETTER_RETENTION_DAYS, else RETENTION_DAYS
    inbox_retention_days: int
    batch_size: int
    idempotency_key_hours: float  # 0 keeps idempotency keys for ever

    @classmethod
    def of(cls, outbox: OutboxSettings, inbox: InboxSettings, *, idempotency_key_hours: float) -> Self:
        """The policy from ``OUTBOX__*`` and ``INBOX__*`` (and ``API__IDEMPOTENCY_KEY_RETENTION_HOURS``)."""
        return cls(
            retention_days=outbox.retention_days,
            dead_letter_days=outbox.dead_letter_window_days,
            inbox_retention_days=inbox.retention_days,
            idempotency_key_hours=idempotency_key_hours,
            batch_size=outbox.cleanup_batch_size,
        )


class RetentionCleaner:
    """One sweep deletes everything past retention, batch by batch."""

    def __init__(
        self, *, database: Database, policy: RetentionPolicy, clock: Clock, metrics: RelayMetrics
    ) -> None:
        self._db = database
        self._policy = policy
        self._clock = clock
        self._metrics = metrics

    async def _delete_batches(
        self, table: sa.Table, keys: list[sa.Column[object]], where: sa.ColumnElement[bool]
    ) -> int:
        total = 0
        key = keys[0] if len(keys) == 1 else sa.tuple_(*keys)
        while True:
            chosen = sa.select(*keys).where(where).limit(self._policy.batch_size)
            statement = sa.delete(table).where(key.in_(chosen)).returning(keys[0])
            async with self._db.session() as session:
                deleted = len((await session.exec(statement)).all())
                await session.commit()
            total += deleted
            if deleted < self._policy.batch_size:
                return total
            await asyncio.sleep(0)  # let the hot path in between batches

    async def sweep(self) -> dict[str, int]:
        """Delete what is past retention; return counts by ``table:state``."""
        now = self._clock()
        counts: dict[str, int] = {}
        policy = self._policy
        for source in POLLED_TABLES.values():
            t = source.table.c
            if policy.retention_days > 0:
                cutoff = now - timedelta(days=policy.retention_days)
                counts[f"{source.name}:processed"] = await self._delete_batches(
                    source.table, [t.id], sa.and_(t.processed_on.is_not(None), t.processed_on < cutoff)
                )
            if policy.dead_letter_days > 0:
                cutoff = now - timedelta(days=policy.dead_letter_days)
                counts[f"{source.name}:dead_lettered"] = await self._delete_batches(
                    source.table,
                    [t.id],
                    sa.and_(t.dead_lettered_on.is_not(None), t.dead_lettered_on < cutoff),
                )
        if policy.inbox_retention_days > 0:
            cutoff = now - timedelta(days=policy.inbox_retention_days)
            counts["inbox:consumed"] = await self._delete_batches(
                INBOX, [INBOX.c.message_id, INBOX.c.consumer], INBOX.c.received_on < cutoff
            )
        if policy.idempotency_key_hours > 0:
            cutoff = now - timedelta(hours=policy.idempotency_key_hours)
            counts["idempotency_keys:expired"] = await self._delete_batches(
                KEYS, [KEYS.c.tenant_id, KEYS.c.key], KEYS.c.created_on < cutoff
            )
        self._report(counts)
        return counts

    def _report(self, counts: dict[str, int]) -> None:
        """Count every deletion; one Warning per table that lost rows, naming each state."""
        by_table: dict[str, list[str]] = {}
        for key, count in counts.items():
            if count:
                table, state = key.split(":")
                self._metrics.cleaned.labels(table, state).inc(count)
                by_table.setdefault(table, []).append(f"{count} {state}")
        for table, parts in by_table.items():
            log.warning("retention cleanup deleted %s row(s) from %s", " and ".join(parts), table)

    async def run(self, interval_seconds: float) -> None:
        """Sweep forever (first sweep right away)."""
        while True:
            try:
                await self.sweep()
            except Exception:
                log.exception("retention cleanup failed; retrying at the next interval")
            await asyncio.sleep(interval_seconds)
