"""Cascades past ``OUTBOX__MAX_CASCADE_DEPTH`` (handlers raising events whose handlers raise
events...) are dead-lettered with the reason ``cascade_depth_exceeded`` and an Error log naming
the rows: handing them to the processor would only restart the count (it delivers at depth 1),
so an event loop A -> B -> A would never end. A dead letter is evidence an operator can read and
replay once the loop is fixed; the rows committed so far stay committed."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ..kernel.clock import Clock
from ..persistence.database import Database
from ..polling.leases import LeaseStore
from ..polling.ports import CycleMetrics
from ..polling.retries import CASCADE_DEPTH_EXCEEDED
from ..unit_of_work.rows import WrittenRow

log = logging.getLogger(__name__)


class CascadeDepthError(RuntimeError):
    """Domain events kept raising domain events past the configured depth."""


async def dead_letter_cascade(
    *,
    database: Database,
    clock: Clock,
    store: LeaseStore,
    rows: Sequence[WrittenRow],
    max_depth: int,
    metrics: CycleMetrics | None,
) -> None:
    names = ", ".join(sorted({row.message.message_name for row in rows}))
    error = CascadeDepthError(
        f"domain events cascaded past depth {max_depth} (OUTBOX__MAX_CASCADE_DEPTH): a handler "
        f"chain keeps raising events; {len(rows)} row(s) of {names} dead-lettered"
    )
    log.error("%s (rows %s)", error, ", ".join(str(row.id) for row in rows))
    now = clock()
    try:
        async with database.bookkeeping() as connection:
            for row in rows:
                await store.record_failure(
                    connection,
                    row.id,
                    row.lock_token,
                    now=now,
                    error=repr(error),
                    retry_count=0,
                    retry_at=now,
                    dead_letter_reason=CASCADE_DEPTH_EXCEEDED,
                )
    except Exception:
        # Best effort, like a release: the rows then wait out their lease for the processor.
        log.exception("could not dead-letter %s outbox row(s) past the cascade depth", len(rows))
        return
    if metrics is not None:
        metrics.dead_lettered("outbox", CASCADE_DEPTH_EXCEEDED, len(rows))
