"""What an operator's request may touch, what it answers with, and whose rows it sees.

Every operation works within a :class:`TenantScope`: the admin API passes the token's tenant
(role ``outbox-admin``), so another tenant's row is exactly as unknown as a row that does not
exist; the operator role and the CLI see every tenant (:data:`EVERY_TENANT`), rows without a
tenant included.

What the admin API and the CLI show of a polled table's rows: never a payload (payloads can
carry personal data, and no replay decision depends on them).

What an operator's request may touch, and the mistakes it can make.

A request an operator can fix (an unknown source or id, paging out of range) raises
:class:`AdminError` with a readable message; an id that names no row raises
:class:`RowNotFoundError` (404). Whose rows a request sees is its :class:`TenantScope`."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from outbox_kit.persistence.tables import POLLED_TABLES, PolledTable, UnknownSourceError, source_named


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


def sources_named(name: str | None) -> list[PolledTable]:
    try:
        return list(POLLED_TABLES.values()) if name in (None, "", "all") else [source_named(str(name))]
    except UnknownSourceError as error:
        raise AdminError(str(error)) from None


def one_source(name: str | None, verb: str) -> PolledTable:
    if name in (None, "", "all"):
        msg = f"{verb} needs one source: {' or '.join(POLLED_TABLES)}"
        raise AdminError(msg)
    return sources_named(name)[0]


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
