"""Roles travel flattened: one comma-joined text of at most 512 characters, in a header and in an
outbox column. Whole roles that would cross the cap are dropped, never cut, so a role is never
stored as a prefix of itself."""

from __future__ import annotations

from collections.abc import Iterable

MAX_ROLES_LENGTH = 512


def flatten_roles(roles: Iterable[str]) -> str | None:
    """Comma-join roles, dropping whole roles that would cross the 512-character cap."""
    kept: list[str] = []
    length = 0
    for role in roles:
        cleaned = role.replace(",", "").strip()
        if not cleaned:
            continue
        extra = len(cleaned) + (1 if kept else 0)
        if length + extra > MAX_ROLES_LENGTH:
            break
        kept.append(cleaned)
        length += extra
    return ",".join(kept) or None


def split_roles(flattened: str | None) -> tuple[str, ...]:
    return tuple(r for r in (flattened or "").split(",") if r)
