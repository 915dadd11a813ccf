"""The rows an operator sees and touches: what a request may ask for and whose rows it sees
(``TenantScope``), what it is answered with (never a payload), and explaining and replaying rows.

**Explain**: why one row is or is not moving: processed, unrouted (published with no subscriber
bound), dead-lettered, blocked behind a row of its key (an earlier one, or a later one still in
flight ahead of a replayed head), leased, paused, backing off, delayed, or eligible now.

**Replay**: dead letters back to the pending pool, all or nothing. A replayed row gets
``retry_count = 0`` and its lease cleared; it keeps ``last_error`` (the first thing anyone asks
after a replay) and ``occurred_on`` and ``seq`` (its place in its ordering key). One unknown id,
or one that is not a dead letter, refuses the whole request. The caller records who replayed
what, in the same transaction. On PostgreSQL a replay and the claims of its table never overlap
(``processor.claim``): a replayed head is then never claimed beside a later row of its key that
a claim under way took."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlmodel.ext.asyncio.session import AsyncSession

from outbox_kit.application.clock import Clock
from outbox_kit.persistence.database import Database
from outbox_kit.persistence.tables import (
    DEFAULT_SOURCE,
    PAUSED_PREFIX,
    POLLED_TABLES,
    UNROUTED_PREFIX,
    PolledTable,
    qualified_name,
)
from outbox_kit.processor.claim import replay_gate

# -- requests ----------------------------------------------------------------------------------------
# What an operator's request may touch, what it answers with, and whose rows it sees.
#
# Every operation works within a :class:`TenantScope`: the admin API passes the token's tenant
# (role ``outbox-admin``), so another tenant's row is exactly as unknown as a row that does not
# exist; the operator role and the CLI see every tenant (:data:`EVERY_TENANT`), rows without a
# tenant included.
#
# What the admin API and the CLI show of a polled table's rows: never a payload (payloads can
# carry personal data, and no replay decision depends on them).
#
# What an operator's request may touch, and the mistakes it can make.
#
# A request an operator can fix (an unknown source or id, paging out of range) raises
# :class:`AdminError` with a readable message; an id that names no row raises
# :class:`RowNotFoundError` (404). Whose rows a request sees is its :class:`TenantScope`.


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


MAX_PAGE = 500
# Paging past this many dead letters by offset is not a use: filter by source, or replay first.
# (Each source is read up to offset + limit rows, so the cap also bounds one request's work.)
MAX_OFFSET = 10_000


class AdminError(ValueError):
    """A request an operator can fix (unknown source or id, bad paging)."""


class RowNotFoundError(AdminError):
    """The id names no row of the source (the admin API answers 404)."""


class NothingToReplayError(AdminError):
    """A replay would return nothing to the pending pool: a row it names is not (or no longer)
    dead-lettered, already replayed by someone else, say (the admin API answers 409)."""

    def __init__(self, ids: Sequence[str]) -> None:
        super().__init__(
            f"nothing to replay: not dead-lettered (already replayed?): {', '.join(sorted(ids))}"
        )


@dataclass(frozen=True)
class Target:
    """One polled table of one source, by the name operators use for it (``outbox``,
    ``notifications.outbox``)."""

    name: str
    database: Database
    polled: PolledTable

    @property
    def table(self) -> sa.Table:
        return self.polled.table

    @property
    def name_column(self) -> str:
        return self.polled.name_column


class Targets:
    """The polled tables of every source. A request names all of them (no name, ``all``), one
    source's (``notifications``), or one table (``outbox`` and ``internal_commands`` are the
    default source's; ``notifications.outbox`` is another source's)."""

    def __init__(self, databases: Mapping[str, Database]) -> None:
        self._by_source = {
            source: [
                Target(qualified_name(source, polled.name), database, polled)
                for polled in POLLED_TABLES.values()
            ]
            for source, database in databases.items()
        }
        self._by_name = {target.name: target for targets in self._by_source.values() for target in targets}

    @property
    def tables(self) -> list[str]:
        """Every name that selects one table."""
        return list(self._by_name)

    @property
    def selections(self) -> list[str]:
        """Every name a request may give: a table, or a source other than the default."""
        return [*self._by_name, *(source for source in self._by_source if source != DEFAULT_SOURCE)]

    def named(self, name: str | None) -> list[Target]:
        if name in (None, "", "all"):
            return list(self._by_name.values())
        name = str(name)
        if name in self._by_name:
            return [self._by_name[name]]
        if name in self._by_source:
            return self._by_source[name]
        msg = f"unknown source {name!r}; use one of: {', '.join(self.selections)}"
        raise AdminError(msg)

    def one(self, name: str | None, verb: str) -> Target:
        found = [] if name in (None, "", "all") else self.named(name)
        if len(found) != 1:
            msg = f"{verb} needs one source: {' or '.join(self._by_name)}"
            raise AdminError(msg)
        return found[0]


def parse_ids(ids: Sequence[str]) -> list[uuid.UUID]:
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


async def explain_row(
    target: Target, clock: Clock, row_id: str, *, scope: TenantScope = EVERY_TENANT
) -> Explanation:
    """Say why one row is or is not moving."""
    table, database = target.polled, target.database
    (wanted,) = parse_ids([row_id])
    c = table.table.c
    now = clock()
    async with database.session() as session:
        row = (
            await session.exec(sa.select(table.table).where(c.id == wanted, scope.admits(table.table)))  # type: ignore[call-overload]
        ).first()
        if row is None:
            msg = f"no {target.name} row has id {row_id}"
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
        source=target.name,
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
        if (row.last_error or "").startswith(UNROUTED_PREFIX):
            return "unrouted", (
                f"published with no subscriber bound (unrouted) at {row.processed_on.isoformat()}, "
                f"so marked processed: {row.last_error.removeprefix(UNROUTED_PREFIX)}"
            )
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


async def refuse_unless_replayable(
    session: AsyncSession, table: Target, wanted: list[uuid.UUID], scope: TenantScope
) -> None:
    """Every id must name a dead letter the caller may see (another tenant's row is unknown)."""
    c = table.table.c
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
        raise NothingToReplayError(alive)


async def return_to_pending(
    session: AsyncSession,
    table: Target,
    wanted: list[uuid.UUID],
    scope: TenantScope,
    *,
    gate_idle_timeout_seconds: float | None,
) -> list[str]:
    """Reset the dead letters (retries, lease) and return the ids replayed, sorted.

    On PostgreSQL (``gate_idle_timeout_seconds`` given) the table's replay gate is taken first,
    held until the caller commits: a claim under way when a replayed head appears could
    otherwise put a second row of its key in flight (``processor.claim``)."""
    c = table.table.c
    if gate_idle_timeout_seconds is not None:
        gate = replay_gate(table.table, idle_timeout_seconds=gate_idle_timeout_seconds)
        await session.exec(gate)  # type: ignore[call-overload]
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
    return sorted(str(row[0]) for row in replayed)
