"""The claim: one atomic ``UPDATE ... WHERE id IN (... FOR UPDATE SKIP LOCKED) RETURNING``.

Why one statement: a SELECT-then-UPDATE lets two processors read the same rows before either
writes (measured: 657 claims for 200 rows with six PostgreSQL workers without SKIP LOCKED; 60
selected for 18 unique on SQLite without BEGIN IMMEDIATE). Here the lease is taken by the same
statement that chooses the rows, so a race resolves per row: a row is leased to exactly one
token.

The shape is the "windowed head claim" of ``notes/claim-sql.md``:

* **keyless** rows are taken FIFO by ``seq`` and never pay for keyed backlogs;
* **keyed** rows are claimable only when they are the *head* of their key: no earlier row with
  the same key is still pending (``NOT EXISTS``). The guard sits inside the claim, so it holds
  across replicas; only a key's lowest pending row can pass it, so a batch never holds two rows
  of one key; a leased or backing-off head keeps blocking; a dead-lettered head releases the key.
* a head is not claimable while **another row of its key is in flight** (leased, lease not
  over). Only a replayed dead letter can be a head behind a row already running (the dead letter
  had released its key), and one key must never have two deliveries at once. The check probes a
  small partial index of leased keyed rows, so it costs one index lookup per head.
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

from .claimed import ClaimedRow


def _pending(t: sa.FromClause) -> sa.ColumnElement[bool]:
    # Written exactly as the partial-index predicates, so both planners use those indexes.
    return sa.and_(t.c.processed_on.is_(None), t.c.dead_lettered_on.is_(None))


def _free_and_due(t: sa.FromClause) -> sa.ColumnElement[bool]:
    now = sa.bindparam("now", type_=UTCDateTime())
    return sa.and_(
        sa.or_(t.c.locked_until.is_(None), t.c.locked_until < now),
        t.c.available_on <= now,
    )


def _no_key_mate_in_flight(table: sa.Table, t: sa.FromClause) -> sa.ColumnElement[bool]:
    # Written to match the partial index ``pending_leased_key``'s predicate.
    mate = table.alias("mate")
    return ~sa.exists().where(
        mate.c.ordering_key == t.c.ordering_key,
        mate.c.ordering_key.is_not(None),
        mate.c.lock_token.is_not(None),
        _pending(mate),
        mate.c.locked_until >= sa.bindparam("now", type_=UTCDateTime()),
    )


def build_claim(table: sa.Table, name_column: str, *, batch: int, window: int) -> sa.Update:
    """Build the claim statement for ``table`` (bound: now, lease_until, token, locked_by)."""
    alias = table.alias
    k0, w0, a, b, h, m, k1 = (alias(n) for n in ("k0", "w0", "a", "b", "h", "m", "k1"))

    keyless = (
        sa.select(k0.c.id, k0.c.seq)
        .where(k0.c.ordering_key.is_(None), _pending(k0), _free_and_due(k0))
        .order_by(k0.c.seq)
        .limit(batch)
        .with_for_update(skip_locked=True)
        .cte("keyless")
    )
    win = (
        sa.select(w0.c.id, w0.c.seq, w0.c.ordering_key)
        .where(w0.c.ordering_key.is_not(None), _pending(w0), _free_and_due(w0))
        .order_by(w0.c.seq)
        .limit(window)
        .subquery("win")
    )
    earlier = table.alias("e")
    no_earlier = ~sa.exists().where(
        earlier.c.ordering_key == win.c.ordering_key, earlier.c.seq < win.c.seq, _pending(earlier)
    )
    win_heads = (
        sa.select(win.c.id, win.c.seq).where(no_earlier).order_by(win.c.seq).limit(batch).cte("win_heads")
    )
    short = sa.select(sa.func.count()).select_from(win_heads).scalar_subquery() < batch
    seed = (
        sa.select(sa.func.min(a.c.ordering_key).label("k"))
        .where(a.c.ordering_key.is_not(None), _pending(a))
        .subquery("seed")
    )
    keys = sa.select(seed.c.k).where(short).cte("keys", recursive=True)
    keys = keys.union_all(
        sa.select(
            sa.select(sa.func.min(b.c.ordering_key))
            .where(b.c.ordering_key > keys.c.k, _pending(b))
            .scalar_subquery()
        ).where(keys.c.k.is_not(None))
    )
    head_seq = (
        sa.select(sa.func.min(h.c.seq)).where(h.c.ordering_key == keys.c.k, _pending(h)).scalar_subquery()
    )
    skip_heads = (
        sa.select(m.c.id, m.c.seq)
        .where(
            m.c.seq.in_(sa.select(head_seq).select_from(keys).where(keys.c.k.is_not(None))),
            _free_and_due(m),
        )
        .order_by(m.c.seq)
        .limit(batch)
        .cte("skip_heads")
    )
    chosen = sa.union_all(sa.select(win_heads.c.id).where(~short), sa.select(skip_heads.c.id))
    keyed = (
        sa.select(k1.c.id, k1.c.seq)
        .where(k1.c.id.in_(chosen), _pending(k1), _free_and_due(k1), _no_key_mate_in_flight(table, k1))
        .with_for_update(skip_locked=True)
        .cte("keyed")
    )
    both = sa.union_all(sa.select(keyless.c.id, keyless.c.seq), sa.select(keyed.c.id, keyed.c.seq)).subquery(
        "both_"
    )
    picked = sa.select(both.c.id).order_by(both.c.seq).limit(batch).cte("picked")
    c = table.c
    return (
        sa.update(table)
        .where(c.id.in_(sa.select(picked.c.id)))
        .values(
            locked_until=sa.bindparam("lease_until", type_=UTCDateTime()),
            lock_token=sa.bindparam("token", type_=sa.Uuid()),
            locked_by=sa.bindparam("locked_by", type_=sa.String()),
        )
        .returning(
            c.id,
            c.seq,
            c[name_column].label("name"),
            c.payload,
            c.ordering_key,
            c.retry_count,
            c.occurred_on,
            c.locked_until,
            c.tenant_id,
            c.user_id,
            c.user_roles,
            c.correlation_id,
            c.trace_context,
            (c.kind if "kind" in c else sa.null()).label("kind"),
            c.last_error,
        )
    )


class Claimer:
    """Executes the prebuilt claim in its own short transaction."""

    def __init__(self, table: sa.Table, name_column: str, *, batch: int, window: int) -> None:
        self.statement = build_claim(table, name_column, batch=batch, window=window)

    async def claim(
        self,
        connection: AsyncConnection,
        *,
        now: datetime,
        lease_until: datetime,
        token: uuid.UUID,
        locked_by: str,
    ) -> list[ClaimedRow]:
        result = await connection.execute(
            self.statement, {"now": now, "lease_until": lease_until, "token": token, "locked_by": locked_by}
        )
        rows = [ClaimedRow(**dict(row._asdict())) for row in result]
        rows.sort(key=lambda row: row.seq)
        return rows
