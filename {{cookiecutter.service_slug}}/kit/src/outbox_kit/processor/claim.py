"""The claim: which rows a cycle takes, under which lease, in one statement.

A claimed row (:class:`ClaimedRow`) is leased to this processor for one delivery attempt. A
delivery slot (:class:`DeliverySlot`) is one of ``delivery_concurrency`` publishes (or handler
runs) in flight; a row gives its slot back as soon as its delivery ended, before its stamp is
written: the stamp waits for its group (``outcomes``), and a slot held through that wait would
idle the broker.

**One statement**: ``UPDATE ... WHERE id IN (... FOR UPDATE SKIP LOCKED) RETURNING``. A
SELECT-then-UPDATE lets two processors read the same rows before either writes (measured: 657
claims for 200 rows with six PostgreSQL workers without SKIP LOCKED; 60 selected for 18 unique on
SQLite without BEGIN IMMEDIATE). Here the lease is taken by the statement that chooses the rows,
so a race resolves per row: a row is leased to exactly one token.

**Its shape**, a "windowed head claim", built from parts that each select *candidates*: rows that
are pending (neither processed nor dead-lettered, written exactly as the partial-index
predicates, so both planners use those indexes), free and due (no live lease, ``available_on``
passed). Time is the bound ``now``.

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

**The replay gate** (PostgreSQL), between the claims of a polled table and the replays of its
dead letters. A replay is the one change that puts a row back *before* rows of its key that
already left (a dead letter had released its key). The claim's key-head test runs on the
snapshot its statement took. A claim whose snapshot was taken before a replay committed, and
which commits after a second claim took its own snapshot, sees the key's next row as the head
while the second claim sees the replayed row as the head and cannot yet see the first one's
lease: both are leased, two rows of one key in flight (reproduced in ``test_claim_races``). No
test inside one statement can close this: its snapshot predates anything it could lock.

So a claim first takes this table's gate in *shared* mode, in its own transaction and before its
statement (whose snapshot is then taken after the gate is held), and a replay takes it
*exclusive* before it changes a row. Claims never wait for each other; a replay waits for the
claims under way to commit (their leases are then visible to every later claim) and the claims
that come meanwhile wait for the replay to commit (their snapshots then show the replayed row).
Writers of new rows are not involved (their per-key lock orders ``seq``, a different key space).
SQLite needs no gate: a claim there is one write transaction and writers are serialized."""

from __future__ import annotations

import asyncio
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from types import TracebackType
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlmodel.sql.sqltypes import UTCDateTime

from outbox_kit.application.context import CapturedContext


@dataclass(frozen=True)
class ClaimedRow:
    """A row leased to this processor for one delivery attempt."""

    id: uuid.UUID
    seq: int
    name: str
    payload: dict[str, Any]
    ordering_key: str | None
    retry_count: int
    occurred_on: datetime
    locked_until: datetime
    tenant_id: str | None
    user_id: str | None
    user_roles: str | None
    correlation_id: str | None
    trace_context: str | None
    kind: str | None
    last_error: str | None = None

    def captured_context(self) -> CapturedContext:
        """The request context the row was written under, to restore for its delivery."""
        return CapturedContext(
            tenant_id=self.tenant_id,
            user_id=self.user_id,
            user_roles=self.user_roles,
            correlation_id=self.correlation_id,
            traceparent=self.trace_context,
        )


class DeliverySlot:
    """Held from the start of a row's delivery until ``free()`` or the end of the row;
    ``ended`` is told once, when it is freed (the stamp groups count the batch's deliveries)."""

    def __init__(self, gate: asyncio.Semaphore, ended: Callable[[], None] | None = None) -> None:
        self._gate = gate
        self._ended = ended
        self._held = False

    async def __aenter__(self) -> DeliverySlot:
        await self._gate.acquire()
        self._held = True
        return self

    def free(self) -> None:
        """Let the next row start; idempotent."""
        if self._held:
            self._held = False
            self._gate.release()
            if self._ended is not None:
                self._ended()

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.free()


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


# Two 32-bit keys (the advisory-lock space of pg_advisory_xact_lock(int, int)): never the same
# lock as a writer's per-key one, which takes the single bigint form.
_GATE_CLASS = 0x52454C41  # "RELA"


def _gate_keys(table: sa.Table) -> tuple[int, int]:
    return _GATE_CLASS, zlib.crc32(table.name.encode()) & 0x7FFFFFFF


def claim_gate(table: sa.Table) -> sa.Select[tuple[object]]:
    """What a claim runs first in its transaction: the gate, shared with the other claims."""
    first, second = _gate_keys(table)
    return sa.select(sa.func.pg_advisory_xact_lock_shared(first, second))


def replay_gate(table: sa.Table, *, idle_timeout_seconds: float) -> sa.Select[tuple[object, object]]:
    """What a replay runs before it changes a row: the gate, exclusive (it waits for the claims
    under way, and holds new ones until the replay commits). Its transaction is also ended by
    the server once idle ``idle_timeout_seconds``: a replay whose process froze must not stop
    the relay of every replica for longer than that."""
    first, second = _gate_keys(table)
    idle = f"{max(1, int(idle_timeout_seconds * 1000))}ms"
    return sa.select(
        sa.func.set_config("idle_in_transaction_session_timeout", idle, True),  # noqa: FBT003 (SQL's is_local)
        sa.func.pg_advisory_xact_lock(first, second),
    )


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
