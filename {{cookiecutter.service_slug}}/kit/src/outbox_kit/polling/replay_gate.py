"""The gate between the claims of a polled table and the replays of its dead letters (PostgreSQL).

Why: a replay is the one change that puts a row back *before* rows of its key that already
left (a dead letter had released its key). The claim's key-head test runs on the snapshot its
statement took. A claim whose snapshot was taken before a replay committed, and which commits
after a second claim took its own snapshot, sees the key's next row as the head while the second
claim sees the replayed row as the head and cannot yet see the first one's lease: both are
leased, two rows of one key in flight (reproduced in ``test_claim_races``). No test inside one
statement can close this: its snapshot predates anything it could lock.

So a claim first takes this table's gate in *shared* mode, in its own transaction and before its
statement (whose snapshot is then taken after the gate is held), and a replay takes it
*exclusive* before it changes a row. Claims never wait for each other; a replay waits for the
claims under way to commit (their leases are then visible to every later claim) and the claims
that come meanwhile wait for the replay to commit (their snapshots then show the replayed row).
Writers of new rows are not involved (their per-key lock orders ``seq``, a different key space).

SQLite needs no gate: a claim there is one write transaction and writers are serialized.
"""

from __future__ import annotations

import zlib

import sqlalchemy as sa

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
