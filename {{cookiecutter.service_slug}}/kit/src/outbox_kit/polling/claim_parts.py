"""The parts the claim statement is built from (see ``claim`` for why it is one statement).

Every part selects *candidates*: rows that are pending (neither processed nor dead-lettered,
written exactly as the partial-index predicates, so both planners use those indexes) and free
and due (no live lease, ``available_on`` passed). The parts that finally lock rows do so with
``FOR UPDATE SKIP LOCKED`` inside their CTE (PostgreSQL refuses it next to a UNION or an
aggregate); SQLite drops it and serializes writers instead. Time is the bound ``now``.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlmodel.sql.sqltypes import UTCDateTime


def pending(t: sa.FromClause) -> sa.ColumnElement[bool]:
    return sa.and_(t.c.processed_on.is_(None), t.c.dead_lettered_on.is_(None))


def free_and_due(t: sa.FromClause) -> sa.ColumnElement[bool]:
    now = sa.bindparam("now", type_=UTCDateTime())
    return sa.and_(sa.or_(t.c.locked_until.is_(None), t.c.locked_until < now), t.c.available_on <= now)


def among(
    column: sa.ColumnElement[Any], ids: sa.Select[Any] | sa.CompoundSelect[Any], *, postgresql: bool
) -> sa.ColumnElement[bool]:
    """``column`` is one of ``ids``. On PostgreSQL written ``= ANY(ARRAY(...))``: the planner
    then probes the index once per id, where ``IN (subquery)`` let it hash-join a sequential
    scan of the whole table (seen in the claim's plan; ``test_relay_hot_path`` checks it)."""
    if postgresql:
        return column == sa.any_(sa.func.array(ids.scalar_subquery()))
    return column.in_(ids)


def no_key_mate_in_flight(table: sa.Table, t: sa.FromClause) -> sa.ColumnElement[bool]:
    """No other row of the key holds a live lease (only a replayed head can be behind one);
    written to match the partial index ``pending_leased_key``."""
    mate = table.alias("mate")
    return ~sa.exists().where(
        mate.c.ordering_key == t.c.ordering_key,
        mate.c.ordering_key.is_not(None),
        mate.c.lock_token.is_not(None),
        pending(mate),
        mate.c.locked_until >= sa.bindparam("now", type_=UTCDateTime()),
    )


def claimable_keyless(table: sa.Table, batch: int) -> sa.CTE:
    """Keyless rows, first in ``seq`` order: they never pay for keyed backlogs."""
    row = table.alias("keyless_row")
    return (
        sa.select(row.c.id, row.c.seq)
        .where(row.c.ordering_key.is_(None), pending(row), free_and_due(row))
        .order_by(row.c.seq)
        .limit(batch)
        .with_for_update(skip_locked=True)
        .cte("keyless")
    )


def heads_in_window(table: sa.Table, batch: int, window: int) -> sa.CTE:
    """Heads of their keys (no earlier pending row of the same key) among the ``window`` oldest
    claimable keyed rows: the cheap way to find heads when keys are many and short."""
    row, earlier = table.alias("window_row"), table.alias("earlier_row")
    in_window = (
        sa.select(row.c.id, row.c.seq, row.c.ordering_key)
        .where(row.c.ordering_key.is_not(None), pending(row), free_and_due(row))
        .order_by(row.c.seq)
        .limit(window)
        .subquery("window_rows")
    )
    no_earlier = ~sa.exists().where(
        earlier.c.ordering_key == in_window.c.ordering_key, earlier.c.seq < in_window.c.seq, pending(earlier)
    )
    return (
        sa.select(in_window.c.id, in_window.c.seq)
        .where(no_earlier)
        .order_by(in_window.c.seq)
        .limit(batch)
        .cte("window_heads")
    )


def heads_by_key_scan(table: sa.Table, batch: int, only_if: sa.ColumnElement[bool]) -> sa.CTE:
    """Heads found by a loose index scan over the distinct pending keys (a recursive walk from
    key to next key), run only when the window found fewer heads than the batch: a key with
    thousands of pending rows can then not fill the batch and starve the other keys."""
    first, following = table.alias("first_key"), table.alias("next_key")
    head, row = table.alias("key_head"), table.alias("head_row")
    seed = (
        sa.select(sa.func.min(first.c.ordering_key).label("k"))
        .where(first.c.ordering_key.is_not(None), pending(first))
        .subquery("seed")
    )
    keys = sa.select(seed.c.k).where(only_if).cte("keys", recursive=True)
    keys = keys.union_all(
        sa.select(
            sa.select(sa.func.min(following.c.ordering_key))
            .where(following.c.ordering_key > keys.c.k, pending(following))
            .scalar_subquery()
        ).where(keys.c.k.is_not(None))
    )
    head_seq = sa.select(sa.func.min(head.c.seq)).where(head.c.ordering_key == keys.c.k, pending(head))
    # Matched on (key, seq) among pending rows: the pending key index finds each head directly.
    heads = sa.select(keys.c.k, head_seq.scalar_subquery()).select_from(keys).where(keys.c.k.is_not(None))
    return (
        sa.select(row.c.id, row.c.seq)
        .where(
            sa.tuple_(row.c.ordering_key, row.c.seq).in_(heads),
            row.c.ordering_key.is_not(None),
            pending(row),
            free_and_due(row),
        )
        .order_by(row.c.seq)
        .limit(batch)
        .cte("scanned_heads")
    )


def claimable_heads(
    table: sa.Table, candidates: sa.CompoundSelect[tuple[Any]], *, postgresql: bool
) -> sa.CTE:
    """The candidate heads, locked, re-checked free and due, and without a key-mate in flight."""
    row = table.alias("keyed_row")
    return (
        sa.select(row.c.id, row.c.seq)
        .where(
            among(row.c.id, candidates, postgresql=postgresql),
            pending(row),
            free_and_due(row),
            no_key_mate_in_flight(table, row),
        )
        .with_for_update(skip_locked=True)
        .cte("keyed")
    )
