"""Operating the relay tables (outbox, internal commands): list and replay dead letters, count
pending rows, explain one row.

Exposed by the admin API and the CLI, always within a tenant scope, with readable errors for what
an operator can fix (``requests``); what they show never includes a payload (``requests``); why a
row is or is not moving is ``explain``'s.

Replay returns dead letters to the pending pool with ``retry_count = 0`` and the lease cleared,
keeps ``last_error`` (the first thing anyone asks after a replay) and keeps ``occurred_on`` and
``seq`` (the row keeps its place in its ordering key), and records who replayed how many, when.
It is all-or-nothing: one unknown or not-dead-lettered id refuses the whole request. A replay
that would replay nothing (the rows are no longer dead letters: a concurrent replay took them)
is refused as such (``NothingToReplayError``, 409 on the admin API) and leaves no audit row."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import sqlalchemy as sa

from outbox_kit.application.clock import Clock
from outbox_kit.operations.rows import (
    EVERY_TENANT,
    MAX_OFFSET,
    MAX_PAGE,
    AdminError,
    DeadLetter,
    Explanation,
    NothingToReplayError,
    PendingCount,
    ReplayResult,
    Targets,
    TenantScope,
    explain_row,
    parse_ids,
    refuse_unless_replayable,
    return_to_pending,
)
from outbox_kit.persistence.database import Database
from outbox_kit.persistence.tables import DeadLetterReplay
from outbox_kit.persistence.writer import wake_replicas


class RelayAdministration:
    """The operator surface over the polled tables of every source (``databases``: source name
    -> its database, the default source first)."""

    def __init__(
        self,
        *,
        databases: Mapping[str, Database],
        clock: Clock,
        wake: Callable[[], None],
        notify_channel: str = "",
    ) -> None:
        self._targets = Targets(databases)
        self.targets = self._targets
        self._clock = clock
        self._wake = wake
        self._channel = notify_channel

    async def list_dead_letters(
        self,
        source: str | None = None,
        *,
        offset: int = 0,
        limit: int = 50,
        scope: TenantScope = EVERY_TENANT,
    ) -> list[DeadLetter]:
        """Dead letters, oldest first, paged; one source or all of them."""
        if not 0 <= offset <= MAX_OFFSET or not 1 <= limit <= MAX_PAGE:
            msg = f"offset must be between 0 and {MAX_OFFSET} and limit between 1 and {MAX_PAGE}"
            raise AdminError(msg)
        found: list[DeadLetter] = []
        for table in self._targets.named(source):
            async with table.database.session() as session:
                c = table.table.c
                statement = (
                    sa.select(
                        c.id,
                        c[table.name_column],
                        c.occurred_on,
                        c.dead_lettered_on,
                        c.dead_letter_reason,
                        c.retry_count,
                        c.last_error,
                        c.ordering_key,
                        c.tenant_id,
                        c.correlation_id,
                    )
                    .where(c.dead_lettered_on.is_not(None), scope.admits(table.table))
                    .order_by(c.occurred_on, c.seq)
                    .limit(offset + limit)
                )
                rows = await session.exec(statement)  # type: ignore[call-overload]
                found.extend(DeadLetter(str(row[0]), table.name, *row[1:]) for row in rows)
        found.sort(key=lambda d: (d.occurred_on, d.source))
        return found[offset : offset + limit]

    async def replay(
        self, source: str, ids: Sequence[str], *, actor: str, scope: TenantScope = EVERY_TENANT
    ) -> ReplayResult:
        """Return dead letters to the pending pool (all or nothing) and record the replay."""
        table = self._targets.one(source, "replay")
        database = table.database
        wanted = parse_ids(ids)
        now = self._clock()
        async with database.session() as session:
            await refuse_unless_replayable(session, table, wanted, scope)
            # The replay gate's transaction is bounded like the processors' own (PostgreSQL).
            idle = database.settings.bookkeeping_idle_timeout_seconds if database.is_postgresql else None
            replayed_ids = await return_to_pending(
                session, table, wanted, scope, gate_idle_timeout_seconds=idle
            )
            missed = {str(i) for i in wanted} - set(replayed_ids)
            if missed:
                # A concurrent replay took them between the check above and the update: all or
                # nothing, and no audit row for a replay that replayed nothing.
                await session.rollback()
                raise NothingToReplayError(sorted(missed))
            session.add(
                DeadLetterReplay(
                    source=table.polled.name,  # the audit row is in the table's own source
                    replayed_by=actor,
                    replayed_on=now,
                    message_count=len(replayed_ids),
                    message_ids=replayed_ids,
                )
            )
            if database.is_postgresql and self._channel:  # wake every replica's processor
                await session.exec(wake_replicas(self._channel))  # type: ignore[call-overload]
            await session.commit()
        self._wake()
        return ReplayResult(table.name, replayed_ids, actor, now)

    async def count_pending(
        self, source: str | None = None, *, scope: TenantScope = EVERY_TENANT
    ) -> list[PendingCount]:
        """Rows not yet delivered (leased ones included), per source, right now."""
        counts: list[PendingCount] = []
        now = self._clock()
        for table in self._targets.named(source):
            async with table.database.session() as session:
                c = table.table.c
                pending = sa.and_(c.processed_on.is_(None), c.dead_lettered_on.is_(None))
                statement = sa.select(
                    sa.func.count().filter(pending),
                    sa.func.count().filter(pending, c.lock_token.is_not(None), c.locked_until > now),
                    sa.func.count().filter(c.dead_lettered_on.is_not(None)),
                ).where(scope.admits(table.table))
                total, leased, dead = (await session.exec(statement)).one()  # type: ignore[call-overload]
                counts.append(PendingCount(table.name, int(total), int(leased), int(dead)))
        return counts

    async def explain(self, source: str, row_id: str, *, scope: TenantScope = EVERY_TENANT) -> Explanation:
        """Say why one row is or is not moving."""
        return await explain_row(self._targets.one(source, "explain"), self._clock, row_id, scope=scope)
