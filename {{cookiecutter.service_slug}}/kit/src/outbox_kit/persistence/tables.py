"""The kit's tables, defined once: the relay tables (outbox, internal commands), the inbox,
dead-letter replays and idempotency keys; the token-guarded writes on the relay rows; and the
helpers a context's tables use.

**The relay tables.** ``outbox_messages`` and ``internal_commands`` share one column set
(:class:`PolledColumns`), so one claim statement, one lease/backoff/dead-letter idiom and one
administration service serve both; operators call them ``outbox`` and ``internal_commands``.
``seq`` is a monotonic per-row sequence (an identity column on PostgreSQL, max+1 under SQLite's
single writer): ordering keys are ordered by it, never by a timestamp that can tie. The partial
indexes cover only pending rows (neither processed nor dead-lettered), so retained history never
slows the claim (``processor/claim.py`` has the statement that uses them). A row leaves the
pending pool stamped or dead-lettered (with its reason); a paused row stays pending, its
``last_error`` marked as a pause, not a failure of its own.

**The service's own records**: one inbox row per consumed message per consumer (its primary key
is the deduplication guard), one row per dead-letter replay, and one row per answered
idempotency key per tenant.

**Token-guarded writes on a relay row.** Every outcome is guarded on the row id and the lock
token *only* (no ``locked_until`` term): an expired lease still lands while no other replica has
claimed the row, and a row another replica re-claimed under a new token is never overwritten.
The one exception is the release of a claim a stop interrupted (``release_claimed``): its ids
are unknown, and the claim's own lease end, which nothing has moved yet, lets an index find its
rows. ``RETURNING id`` says which rows were still ours: rowcount is not reliable across drivers
(-1 for executemany on asyncpg and for ``WITH`` statements on SQLite). What a failure is charged
is the retry rule's (``processor.retries``).

**``upsert``: ``INSERT ... ON CONFLICT`` on PostgreSQL and SQLite alike**, for a context's
tables. "Create the row, or change the one that is there" and "create the row unless it is
there" are races when written as a read followed by a write: two transactions read the same
state and both act on it (a lost update, or a unique violation). One ``INSERT ... ON CONFLICT``
statement is atomic on both databases: the conflict is resolved against the row as it is when
the statement writes, and a concurrent insert of the same key waits for the other transaction
to finish."""

from __future__ import annotations

import uuid
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlmodel import JSON, Field, SQLModel
from sqlmodel.ext.asyncio.session import AsyncSession

from outbox_kit.application.text import storable

PENDING = "processed_on IS NULL AND dead_lettered_on IS NULL"
JSON_TYPE = JSON().with_variant(postgresql.JSONB(), "postgresql")


def polled_table_args(table: str) -> tuple[Any, ...]:
    """Indexes of a polled table: the claim's four, the smart wait's two, cleanup's two."""

    def partial(name: str, *columns: str, where: str) -> sa.Index:
        return sa.Index(
            f"ix_{table}_{name}",
            *columns,
            postgresql_where=sa.text(where),
            sqlite_where=sa.text(where),
        )

    return (
        sa.UniqueConstraint("seq", name=f"uq_{table}_seq"),
        partial("pending_keyless", "seq", where=f"{PENDING} AND ordering_key IS NULL"),
        partial("pending_keyed_seq", "seq", where=f"{PENDING} AND ordering_key IS NOT NULL"),
        partial("pending_key_seq", "ordering_key", "seq", where=f"{PENDING} AND ordering_key IS NOT NULL"),
        # Keys with a row in flight: few rows (only live leases), probed once per claimed head.
        partial(
            "pending_leased_key",
            "ordering_key",
            where=f"{PENDING} AND ordering_key IS NOT NULL AND lock_token IS NOT NULL",
        ),
        partial("pending_locked", "locked_until", where=f"{PENDING} AND locked_until IS NOT NULL"),
        partial("pending_available", "available_on", where=f"{PENDING} AND locked_until IS NULL"),
        partial("processed_age", "processed_on", where="processed_on IS NOT NULL"),
        partial("dead_letter_age", "dead_lettered_on", where="dead_lettered_on IS NOT NULL"),
    )


class PolledColumns(SQLModel):
    """Columns shared by every table a polling processor drains."""

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    # Field(sa_type=...) rather than sa_column=Column(...): each table needs its own Column.
    seq: int | None = Field(
        default=None, sa_type=sa.BigInteger, sa_column_args=[sa.Identity()], nullable=False
    )
    payload: dict[str, Any] = Field(sa_type=JSON_TYPE, nullable=False)
    occurred_on: datetime
    available_on: datetime
    ordering_key: str | None = Field(default=None, max_length=200)
    tenant_id: str | None = Field(default=None, max_length=64)
    user_id: str | None = Field(default=None, max_length=128)
    user_roles: str | None = Field(default=None, max_length=512)
    correlation_id: str | None = Field(default=None, max_length=64)
    trace_context: str | None = Field(default=None, max_length=128)
    retry_count: int = Field(default=0, sa_column_kwargs={"server_default": "0"})
    last_error: str | None = Field(default=None, sa_type=sa.Text)
    locked_until: datetime | None = None
    lock_token: uuid.UUID | None = None
    locked_by: str | None = Field(default=None, max_length=128)
    processed_on: datetime | None = None
    dead_lettered_on: datetime | None = None
    dead_letter_reason: str | None = Field(default=None, max_length=64)


class OutboxMessage(PolledColumns, table=True):
    """One event written in the same transaction as the business change that raised it.

    ``kind`` is ``domain`` (dispatched in-process, possibly inserted already leased to the
    committing process) or ``integration`` (published through the message bus).
    """

    __tablename__ = "outbox_messages"
    __table_args__ = polled_table_args("outbox_messages")

    event_name: str = Field(max_length=200)
    kind: str = Field(max_length=16)


class InternalCommandRow(PolledColumns, table=True):
    """A deferred instruction, run by the internal-command processor when due."""

    __tablename__ = "internal_commands"
    __table_args__ = polled_table_args("internal_commands")

    command_name: str = Field(max_length=200)


# -- the one definition the rest of the service uses ----------------------------------------

OUTBOX_TABLE: sa.Table = OutboxMessage.__table__  # type: ignore[attr-defined]
COMMAND_TABLE: sa.Table = InternalCommandRow.__table__  # type: ignore[attr-defined]
DOMAIN = "domain"  # an outbox row dispatched in-process (a domain event)
INTEGRATION = "integration"  # an outbox row published through the message bus


@dataclass(frozen=True)
class PolledTable:
    """A table a processor drains, by the name operators use for it."""

    name: str
    table: sa.Table
    name_column: str


OUTBOX = PolledTable("outbox", OUTBOX_TABLE, "event_name")
INTERNAL_COMMANDS = PolledTable("internal_commands", COMMAND_TABLE, "command_name")
POLLED_TABLES: dict[str, PolledTable] = {t.name: t for t in (OUTBOX, INTERNAL_COMMANDS)}


class InboxMessage(SQLModel, table=True):
    """One consumed message per consumer; the primary key is the deduplication guard."""

    __tablename__ = "inbox_messages"
    __table_args__ = (sa.Index("ix_inbox_messages_received_on", "received_on"),)

    message_id: str = Field(primary_key=True, max_length=128)
    consumer: str = Field(primary_key=True, max_length=200)
    event_name: str = Field(max_length=200)
    tenant_id: str | None = Field(default=None, max_length=64)
    correlation_id: str | None = Field(default=None, max_length=64)
    received_on: datetime
    # SHA-256 (hex) of the signed body: a later message under this id with another body is a
    # conflict, not a copy. NULL on rows received before the column existed.
    body_digest: str | None = Field(default=None, max_length=64)


class DeadLetterReplay(SQLModel, table=True):
    """Audit record of one replay: who returned which dead letters to the pending pool, when."""

    __tablename__ = "dead_letter_replays"

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    source: str = Field(max_length=32)
    replayed_by: str = Field(max_length=128)
    replayed_on: datetime
    message_count: int
    message_ids: list[str] = Field(sa_type=JSON_TYPE, nullable=False)


class IdempotencyKeyRow(SQLModel, table=True):
    """One create request per ``(tenant, Idempotency-Key)``, written in the transaction that ran
    it, with the answer it got (see ``persistence/idempotency.py``). The primary key is the guard that
    makes a concurrent retry wait for, then repeat, the first answer."""

    __tablename__ = "idempotency_keys"
    __table_args__ = (sa.Index("ix_idempotency_keys_created_on", "created_on"),)

    tenant_id: str = Field(primary_key=True, max_length=64)  # "" for a caller without a tenant
    key: str = Field(primary_key=True, max_length=255)
    fingerprint: str = Field(max_length=64)  # SHA-256 (hex) of the operation and its body
    status_code: int | None = None
    # The answer's exact JSON text (not JSONB, which reorders keys): a replay repeats its bytes.
    response_body: str | None = Field(default=None, sa_type=sa.Text)
    created_on: datetime


INBOX_TABLE: sa.Table = InboxMessage.__table__  # type: ignore[attr-defined]
IDEMPOTENCY_KEYS_TABLE: sa.Table = IdempotencyKeyRow.__table__  # type: ignore[attr-defined]


# The source of every context without one of its own (``SOURCES__<CONTEXT>__...``).
DEFAULT_SOURCE = "default"


def qualified_name(source: str, table: str) -> str:
    """A polled table by the name operators, metrics and logs use: ``outbox`` in the default
    source, ``notifications.outbox`` in the source of the ``notifications`` context."""
    return table if source == DEFAULT_SOURCE else f"{source}.{table}"


def upsert(session: AsyncSession, table: sa.Table) -> postgresql.Insert | sqlite.Insert:
    """An ``INSERT`` into ``table`` for the session's database, with ``on_conflict_do_update``
    and ``on_conflict_do_nothing`` (the same signature on both dialects)."""
    if session.get_bind().dialect.name == "postgresql":
        return postgresql.insert(table)
    return sqlite.insert(table)


MAX_ERROR_LENGTH = 4000

# ``last_error`` of a row released uncharged while its downstream is down (open circuit):
# ``explain`` reports it as paused, not as backing off after a failure of its own.
PAUSED_PREFIX = "paused, not charged: "

# ``last_error`` of a row published with no consumer bound (stamped processed all the same):
# ``explain`` reports it as unrouted, not as a plain delivery.
UNROUTED_PREFIX = "unrouted: "

RETRIES_EXHAUSTED = "retries_exhausted"

TYPE_UNRESOLVABLE = "type_unresolvable"

MALFORMED_PAYLOAD = "malformed_payload"

CASCADE_DEPTH_EXCEEDED = "cascade_depth_exceeded"


class LeaseLostError(RuntimeError):
    """The row no longer carries our token: another processor owns it now."""


@dataclass(frozen=True)
class FailureOutcome:
    """What a failure did to the row."""

    dead_lettered: bool
    retry_count: int
    retry_at: datetime | None


class LeaseStore:
    """The guarded writes for one polled table."""

    def __init__(self, table: sa.Table) -> None:
        self.table = table
        self._c = table.c
        # The stamp of a batch, built once (built per call, with an IN list rendered per call, it
        # cost twice the statement's round trip): ``id = ANY(:ids)`` on PostgreSQL, one array
        # parameter; an expanding IN elsewhere.
        guard = self._c.lock_token == sa.bindparam("token", type_=sa.Uuid())
        stamp = sa.update(table).values(processed_on=sa.bindparam("now"), locked_until=None, lock_token=None)
        any_id = self._c.id == sa.any_(sa.bindparam("ids", type_=postgresql.ARRAY(sa.Uuid())))
        self._stamp = {
            True: stamp.where(any_id, guard).returning(self._c.id),
            False: stamp.where(self._c.id.in_(sa.bindparam("ids", expanding=True)), guard).returning(
                self._c.id
            ),
        }

    def _ours(self, ids: Collection[uuid.UUID], token: uuid.UUID) -> sa.ColumnElement[bool]:
        return sa.and_(self._c.id.in_(list(ids)), self._c.lock_token == token)

    async def stamp_processed(
        self, connection: AsyncConnection, ids: Collection[uuid.UUID], token: uuid.UUID, now: datetime
    ) -> set[uuid.UUID]:
        """Mark rows delivered; return the ids that were still ours."""
        statement = self._stamp[connection.dialect.name == "postgresql"]
        result = await connection.execute(statement, {"ids": list(ids), "token": token, "now": now})
        return {row[0] for row in result}

    async def stamp_unrouted(
        self, connection: AsyncConnection, row_id: uuid.UUID, token: uuid.UUID, now: datetime, note: str
    ) -> bool:
        """Mark a row delivered to nobody (published, no consumer bound) with ``note`` in
        ``last_error`` (prefixed :data:`UNROUTED_PREFIX`); False when it was no longer ours."""
        statement = (
            sa.update(self.table)
            .where(self._ours([row_id], token))
            .values(
                processed_on=now,
                locked_until=None,
                lock_token=None,
                last_error=storable(f"{UNROUTED_PREFIX}{note}", MAX_ERROR_LENGTH),
            )
            .returning(self._c.id)
        )
        return (await connection.execute(statement)).first() is not None

    async def stamped_at(
        self, connection: AsyncConnection, ids: Collection[uuid.UUID], now: datetime
    ) -> set[uuid.UUID]:
        """The rows of ``ids`` stamped processed at exactly ``now``: an earlier attempt of the same
        stamp that was written although its connection dropped before the answer came back."""
        statement = sa.select(self._c.id).where(self._c.id.in_(list(ids)), self._c.processed_on == now)
        return {row[0] for row in await connection.execute(statement)}

    async def release(
        self,
        connection: AsyncConnection,
        ids: Collection[uuid.UUID],
        token: uuid.UUID,
        *,
        error: str | None = None,
        until: datetime | None = None,
    ) -> set[uuid.UUID]:
        """Give rows back without charging a retry (failed in-process attempt, shutdown, open
        circuit). ``until`` keeps them unclaimable for a while (the key stays blocked)."""
        values: dict[str, object] = {"locked_until": until, "lock_token": None, "locked_by": None}
        if error is not None:
            values["last_error"] = storable(error, MAX_ERROR_LENGTH)
        return await self._give_back(connection, self._ours(ids, token), values)

    async def release_claimed(
        self, connection: AsyncConnection, token: uuid.UUID, lease_until: datetime
    ) -> set[uuid.UUID]:
        """Give back, uncharged, every row a claim leased under ``token`` until ``lease_until``
        (a claim whose answer may never have arrived, so its ids are unknown).

        No index covers ``lock_token``: the claim's ``locked_until`` and the pending predicate
        let the pending/locked partial index find the rows, not a scan of the table's history.
        """
        c = self._c
        ours = sa.and_(
            c.lock_token == token,
            c.locked_until == lease_until,
            c.processed_on.is_(None),
            c.dead_lettered_on.is_(None),
        )
        values: dict[str, object] = {"locked_until": None, "lock_token": None, "locked_by": None}
        return await self._give_back(connection, ours, values)

    async def _give_back(
        self, connection: AsyncConnection, ours: sa.ColumnElement[bool], values: dict[str, object]
    ) -> set[uuid.UUID]:
        statement = sa.update(self.table).where(ours).values(**values).returning(self._c.id)
        result = await connection.execute(statement)
        return {row[0] for row in result}

    async def renew(
        self, connection: AsyncConnection, ids: Collection[uuid.UUID], token: uuid.UUID, until: datetime
    ) -> set[uuid.UUID]:
        """Extend the lease just before dispatch; return the ids that were still ours."""
        statement = (
            sa.update(self.table)
            .where(
                self._ours(ids, token),
                self._c.processed_on.is_(None),
                self._c.dead_lettered_on.is_(None),
            )
            .values(locked_until=until)
            .returning(self._c.id)
        )
        result = await connection.execute(statement)
        return {row[0] for row in result}

    async def record_failure(
        self,
        connection: AsyncConnection,
        row_id: uuid.UUID,
        token: uuid.UUID,
        *,
        now: datetime,
        error: str,
        retry_count: int,
        retry_at: datetime,
        dead_letter_reason: str | None,
    ) -> bool:
        """Charge one retry: re-lease for the backoff, or dead-letter with ``reason``."""
        values: dict[str, object] = {
            "retry_count": retry_count,
            "last_error": storable(error, MAX_ERROR_LENGTH),
            "lock_token": None,
            "locked_by": None,
        }
        if dead_letter_reason is None:
            # The row stays leased until the backoff ends, so its key stays blocked meanwhile.
            values["locked_until"] = retry_at
        else:
            values |= {
                "locked_until": None,
                "dead_lettered_on": now,
                "dead_letter_reason": dead_letter_reason,
            }
        statement = (
            sa.update(self.table)
            .where(self._c.id == row_id, self._c.lock_token == token)
            .values(**values)
            .returning(self._c.id)
        )
        result = await connection.execute(statement)
        return result.first() is not None


def lease_until(now: datetime, lease_seconds: float) -> datetime:
    return now + timedelta(seconds=lease_seconds)
