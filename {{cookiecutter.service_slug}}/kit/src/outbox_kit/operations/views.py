"""What the admin API and the CLI show of a polled table's rows: never a payload (payloads can
carry personal data, and no replay decision depends on them)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any


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
