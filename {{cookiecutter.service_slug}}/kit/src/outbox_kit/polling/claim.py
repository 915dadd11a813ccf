"""The claim: one atomic ``UPDATE ... WHERE id IN (... FOR UPDATE SKIP LOCKED) RETURNING``.

Why one statement: a SELECT-then-UPDATE lets two processors read the same rows before either
writes (measured: 657 claims for 200 rows with six PostgreSQL workers without SKIP LOCKED; 60
selected for 18 unique on SQLite without BEGIN IMMEDIATE). Here the lease is taken by the same
statement that chooses the rows, so a race resolves per row: a row is leased to exactly one
token.

The shape is a "windowed head claim" (its parts are in ``claim_parts``):

* **keyless** rows are taken FIFO by ``seq`` and never pay for keyed backlogs;
* **keyed** rows are claimable only when they are the *head* of their key: no earlier row with
  the same key is still pending (``NOT EXISTS``). The guard sits inside the claim, so it holds
  across replicas; only a key's lowest pending row can pass it, so a batch never holds two rows
  of one key; a leased or backing-off head keeps blocking; a dead-lettered head releases the key.
* a head is not claimable while **another row of its key is in flight** (leased, lease not
  over). Only a replayed dead letter can be a head behind a row already running (the dead letter
  had released its key), and one key must never have two deliveries at once. The check probes a
  small partial index of leased keyed rows, so it costs one index lookup per head. The check
  reads the statement's snapshot, so on PostgreSQL a claim and a replay of the same table never
  overlap (``replay_gate``).
* heads are looked for in a bounded **window** of the oldest claimable keyed rows; only when the
  window yields fewer heads than the batch does a loose index scan over the distinct pending keys
  run, so a key with thousands of pending rows cannot fill the batch and starve other keys.
* ``FOR UPDATE SKIP LOCKED`` sits in the CTEs (PostgreSQL rejects it next to UNION/aggregates);
  SQLite drops it and serializes writers instead.

Order is by ``seq`` (monotonic per row), never by a timestamp that can tie. The statement is
built once per table and reused (building it costs milliseconds). Time values come from the
application clock as bound parameters, so SQLite and PostgreSQL behave the same.
"""

from __future__ import annotations

import uuid
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlmodel.sql.sqltypes import UTCDateTime

from .claim_parts import among, claimable_heads, claimable_keyless, heads_by_key_scan, heads_in_window
from .claimed import ClaimedRow
from .replay_gate import claim_gate


def build_claim(
    table: sa.Table, name_column: str, *, batch: int, window: int, postgresql: bool = False
) -> sa.Update:
    """Build the claim statement for ``table`` (bound: now, lease_until, token, locked_by)."""
    keyless = claimable_keyless(table, batch)
    in_window = heads_in_window(table, batch, window)
    short = sa.select(sa.func.count()).select_from(in_window).scalar_subquery() < batch
    by_scan = heads_by_key_scan(table, batch, short)
    candidates = sa.union_all(sa.select(in_window.c.id).where(~short), sa.select(by_scan.c.id))
    keyed = claimable_heads(table, candidates, postgresql=postgresql)
    both = sa.union_all(sa.select(keyless.c.id, keyless.c.seq), sa.select(keyed.c.id, keyed.c.seq)).subquery(
        "both_"
    )
    picked = sa.select(both.c.id).order_by(both.c.seq).limit(batch).cte("picked")
    return lease(table, name_column, picked, postgresql=postgresql)


def lease(table: sa.Table, name_column: str, picked: sa.CTE, *, postgresql: bool) -> sa.Update:
    """Lease the picked rows to the caller's token and return what their delivery needs."""
    c = table.c
    return (
        sa.update(table)
        .where(among(c.id, sa.select(picked.c.id), postgresql=postgresql))
        .values(
            locked_until=sa.bindparam("lease_until", type_=UTCDateTime()),
            lock_token=sa.bindparam("token", type_=sa.Uuid()),
            locked_by=sa.bindparam("locked_by", type_=sa.String()),
        )
        .returning(
            *(c.id, c.seq, c[name_column].label("name"), c.payload, c.ordering_key, c.retry_count),
            *(c.occurred_on, c.locked_until, c.tenant_id, c.user_id, c.user_roles, c.correlation_id),
            *(c.trace_context, (c.kind if "kind" in c else sa.null()).label("kind"), c.last_error),
        )
    )


class Claimer:
    """Executes the prebuilt claim in its own short transaction (``connection``'s, which the
    caller commits: on PostgreSQL the claim takes the table's replay gate first, in it)."""

    def __init__(
        self, table: sa.Table, name_column: str, *, batch: int, window: int, postgresql: bool = False
    ) -> None:
        self.statement = build_claim(table, name_column, batch=batch, window=window, postgresql=postgresql)
        self._gate = claim_gate(table) if postgresql else None

    async def claim(
        self,
        connection: AsyncConnection,
        *,
        now: datetime,
        lease_until: datetime,
        token: uuid.UUID,
        locked_by: str,
    ) -> list[ClaimedRow]:
        if self._gate is not None:
            # Before the claim's statement, so its snapshot already shows any replay that held
            # the gate (``replay_gate``: a snapshot taken earlier can see a wrong key head).
            await connection.execute(self._gate)
        result = await connection.execute(
            self.statement, {"now": now, "lease_until": lease_until, "token": token, "locked_by": locked_by}
        )
        rows = [ClaimedRow(**dict(row._asdict())) for row in result]
        rows.sort(key=lambda row: row.seq)
        return rows
