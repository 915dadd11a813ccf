"""Replay: dead letters back to the pending pool, all or nothing.

A replayed row gets ``retry_count = 0`` and its lease cleared; it keeps ``last_error`` (the first
thing anyone asks after a replay) and ``occurred_on`` and ``seq`` (its place in its ordering
key). One unknown id, or one that is not a dead letter, refuses the whole request. The caller
records who replayed what, in the same transaction. On PostgreSQL a replay and the claims of its
table never overlap (``polling.replay_gate``): a replayed head is then never claimed beside a
later row of its key that a claim under way took.
"""

from __future__ import annotations

import uuid

import sqlalchemy as sa
from sqlmodel.ext.asyncio.session import AsyncSession

from ..persistence.tables import PolledTable
from ..polling.replay_gate import replay_gate
from .requests import AdminError, RowNotFoundError
from .tenant_scope import TenantScope


async def refuse_unless_replayable(
    session: AsyncSession, table: PolledTable, wanted: list[uuid.UUID], scope: TenantScope
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
        msg = f"not dead-lettered (nothing to replay): {', '.join(alive)}"
        raise AdminError(msg)


async def return_to_pending(
    session: AsyncSession,
    table: PolledTable,
    wanted: list[uuid.UUID],
    scope: TenantScope,
    *,
    gate_idle_timeout_seconds: float | None,
) -> list[str]:
    """Reset the dead letters (retries, lease) and return the ids replayed, sorted.

    On PostgreSQL (``gate_idle_timeout_seconds`` given) the table's replay gate is taken first,
    held until the caller commits: a claim under way when a replayed head appears could
    otherwise put a second row of its key in flight (``polling.replay_gate``)."""
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
