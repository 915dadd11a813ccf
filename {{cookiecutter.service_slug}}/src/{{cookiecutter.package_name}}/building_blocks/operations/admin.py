"""Operating the outbox: list and replay dead letters, count pending rows, explain one row.

Exposed by the admin API and the CLI. Every operation raises :class:`AdminError` with a readable
message for an unknown source or id; none shows a payload (payloads can carry personal data and
no replay decision depends on them).

Every operation works within a :class:`TenantScope`: the admin API passes the token's tenant
(role ``outbox-admin``), so another tenant's row is exactly as unknown as a row that does not
exist; the operator role and the CLI see every tenant, rows without a tenant included.

Replay returns dead letters to the pending pool with ``retry_count = 0`` and the lease cleared,
keeps ``last_error`` (the first thing anyone asks after a replay) and keeps ``occurred_on`` and
``seq`` (the row keeps its place in its ordering key), and records who replayed how many, when.
It is all-or-nothing: one unknown or not-dead-lettered id refuses the whole request.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from ..kernel.clock import Clock
from ..persistence.database import Database
from ..persistence.sources import SOURCES, SourceTable, UnknownSourceError, source_named
from ..persistence.tables import DeadLetterReplay
from ..polling.leases import PAUSED_PREFIX
from ..polling.wake import wake_replicas

MAX_PAGE = 500
# Paging past this many dead letters by offset is not a use: filter by source, or replay first.
# (Each source is read up to offset + limit rows, so the cap also bounds one request's work.)
MAX_OFFSET = 10_000


@dataclass(frozen=True)
class TenantScope:
    """The rows a caller may see and replay: one tenant's, or every row (``tenant_id`` None)."""

    tenant_id: str | None

    def admits(self, table: sa.Table) -> sa.ColumnElement[bool]:
        """A WHERE clause (a row without a tenant is admitted by the every-tenant scope only)."""
        return sa.true() if self.tenant_id is None else table.c.tenant_id == self.tenant_id

    def sees(self, tenant_id: str | None) -> bool:
        return self.tenant_id is None or tenant_id == self.tenant_id


EVERY_TENANT = TenantScope(None)


class AdminError(ValueError):
    """A request an operator can fix (unknown source or id, bad paging)."""


class RowNotFoundError(AdminError):
    """The id names no row of the source (the admin API answers 404)."""


@dataclass(frozen=True)
class DeadLetter:
    """A dead letter as an operator sees it (never the payload)."""

    id: str
    source: str
    name: str
    occurred_on: datetime
    dead_lettered_on: datetime
    reason: str | None
    retry_count: int
    last_error: str | None
    ordering_key: str | None
    tenant_id: str | None
    correlation_id: str | None


@dataclass(frozen=True)
class ReplayResult:
    source: str
    replayed: list[str]
    replayed_by: str
    replayed_on: datetime


@dataclass(frozen=True)
class PendingCount:
    source: str
    pending: int
    leased: int
    dead_lettered: int


@dataclass(frozen=True)
class Explanation:
    """Why a row is (not) moving: ``state`` is a stable tag, ``detail`` a sentence."""

    source: str
    id: str
    name: str
    state: str
    detail: str
    retry_count: int
    last_error: str | None
    facts: dict[str, Any]


def _sources(name: str | None) -> list[SourceTable]:
    try:
        return list(SOURCES.values()) if name in (None, "", "all") else [source_named(str(name))]
    except UnknownSourceError as error:
        raise AdminError(str(error)) from None


def _one_source(name: str | None, verb: str) -> SourceTable:
    if name in (None, "", "all"):
        msg = f"{verb} needs one source: {' or '.join(SOURCES)}"
        raise AdminError(msg)
    return _sources(name)[0]


def _parse_ids(ids: Sequence[str]) -> list[uuid.UUID]:
    parsed: list[uuid.UUID] = []
    for raw in ids:
        try:
            parsed.append(uuid.UUID(str(raw)))
        except ValueError:
            msg = f"{raw!r} is not a row id (a UUID)"
            raise AdminError(msg) from None
    if not parsed:
        msg = "give at least one id"
        raise AdminError(msg)
    return parsed


class OutboxAdministration:
    """The operator surface over both polled tables."""

    def __init__(
        self, *, database: Database, clock: Clock, wake: Callable[[], None], notify_channel: str = ""
    ) -> None:
        self._db = database
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
        async with self._db.session() as session:
            for table in _sources(source):
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
        table = _one_source(source, "replay")
        wanted = _parse_ids(ids)
        now = self._clock()
        c = table.table.c
        async with self._db.session() as session:
            rows = (
                await session.exec(  # type: ignore[call-overload]
                    sa.select(c.id, c.dead_lettered_on).where(c.id.in_(wanted), scope.admits(table.table))
                )
            ).all()
            states = {row[0]: row[1] for row in rows}
            unknown = [str(i) for i in wanted if i not in states]
            if unknown:
                msg = f"no {table.name} row has id {', '.join(unknown)}"
                raise RowNotFoundError(msg)
            alive = [str(i) for i in wanted if states[i] is None]
            if alive:
                msg = f"not dead-lettered (nothing to replay): {', '.join(alive)}"
                raise AdminError(msg)
            replayed = (
                await session.exec(
                    sa.update(table.table)
                    .where(c.id.in_(wanted), c.dead_lettered_on.is_not(None), scope.admits(table.table))
                    .values(
                        dead_lettered_on=None,
                        dead_letter_reason=None,
                        retry_count=0,
                        locked_until=None,
                        lock_token=None,
                        locked_by=None,
                    )
                    .returning(c.id)
                )
            ).all()
            replayed_ids = sorted(str(row[0]) for row in replayed)
            session.add(
                DeadLetterReplay(
                    source=table.name,
                    replayed_by=actor,
                    replayed_on=now,
                    message_count=len(replayed_ids),
                    message_ids=replayed_ids,
                )
            )
            if self._db.is_postgresql and self._channel:  # wake every replica's processor
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
        async with self._db.session() as session:
            for table in _sources(source):
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
        table = _one_source(source, "explain")
        (wanted,) = _parse_ids([row_id])
        c = table.table.c
        now = self._clock()
        async with self._db.session() as session:
            row = (
                await session.exec(sa.select(table.table).where(c.id == wanted, scope.admits(table.table)))  # type: ignore[call-overload]
            ).first()
            if row is None:
                msg = f"no {table.name} row has id {row_id}"
                raise RowNotFoundError(msg)
            blocker = None
            if row.ordering_key is not None and row.processed_on is None and row.dead_lettered_on is None:
                blocker = (
                    await session.exec(  # type: ignore[call-overload]
                        sa.select(c.id, c.seq, c.tenant_id)
                        .where(
                            c.ordering_key == row.ordering_key,
                            # an earlier row of the key, or a later one in flight (the claim
                            # holds a replayed head back until its overtaking key-mate is done)
                            sa.or_(
                                c.seq < row.seq,
                                sa.and_(c.id != row.id, c.lock_token.is_not(None), c.locked_until >= now),
                            ),
                            c.processed_on.is_(None),
                            c.dead_lettered_on.is_(None),
                        )
                        .order_by(c.seq)
                        .limit(1)
                    )
                ).first()
        state, detail = _diagnose(row, _blocker_named(blocker, scope), now)
        facts = {
            "seq": row.seq,
            "ordering_key": row.ordering_key,
            "occurred_on": row.occurred_on,
            "available_on": row.available_on,
            "locked_until": row.locked_until,
            "locked_by": row.locked_by,
            "processed_on": row.processed_on,
            "dead_lettered_on": row.dead_lettered_on,
            "dead_letter_reason": row.dead_letter_reason,
            "tenant_id": row.tenant_id,
            "correlation_id": row.correlation_id,
        }
        return Explanation(
            source=table.name,
            id=str(row.id),
            name=getattr(row, table.name_column),
            state=state,
            detail=detail,
            retry_count=row.retry_count,
            last_error=row.last_error,
            facts=facts,
        )


def _blocker_named(blocker: Any, scope: TenantScope) -> str | None:  # noqa: ANN401 (a Row)
    """The row a keyed row waits for, named only when the caller may see it (ordering keys can
    cross tenants; the wait is a fact about the caller's row, the other row is not theirs)."""
    if blocker is None:
        return None
    if scope.sees(blocker.tenant_id):
        return f"row {blocker.id} (seq {blocker.seq})"
    return "an earlier row of another tenant"


def _diagnose(row: Any, blocker: str | None, now: datetime) -> tuple[str, str]:  # noqa: ANN401, PLR0911
    if row.processed_on is not None:
        return "processed", f"processed at {row.processed_on.isoformat()}"
    if row.dead_lettered_on is not None:
        return "dead_lettered", (
            f"dead-lettered at {row.dead_lettered_on.isoformat()} because "
            f"{row.dead_letter_reason} after {row.retry_count} attempt(s): {row.last_error}"
        )
    if blocker is not None:
        return "blocked", (
            f"blocked behind {blocker} on ordering key "
            f"{row.ordering_key!r}; it moves once that row is processed or dead-lettered"
        )
    if row.locked_until is not None and row.locked_until > now:
        if row.lock_token is not None:
            return "leased", (
                f"leased until {row.locked_until.isoformat()} by processor {row.locked_by or '?'}"
            )
        if (row.last_error or "").startswith(PAUSED_PREFIX):
            return "paused", (
                f"paused until {row.locked_until.isoformat()}, no attempt charged "
                f"({row.retry_count} so far): {row.last_error.removeprefix(PAUSED_PREFIX)}"
            )
        return "backing_off", (
            f"backing off until {row.locked_until.isoformat()} after attempt {row.retry_count}: "
            f"{row.last_error}"
        )
    if row.available_on > now:
        return "delayed", f"not eligible before {row.available_on.isoformat()} (processing delay)"
    return "pending", "eligible now; the next poll claims it"
