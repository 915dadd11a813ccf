"""What an operator's request may touch, and the mistakes it can make.

A request an operator can fix (an unknown source or id, paging out of range) raises
:class:`AdminError` with a readable message; an id that names no row raises
:class:`RowNotFoundError` (404). Whose rows a request sees is its ``tenant_scope``.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from ..persistence.sources import UnknownSourceError, source_named
from ..persistence.tables import POLLED_TABLES, PolledTable

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
