"""Roles travel flattened: one comma-joined text of at most 512 bytes in UTF-8 (the unit the
``x-user-roles`` header is bounded in), in a header and in an outbox column. A token whose roles
flatten to more is refused at the API; for a context set by other means, whole roles that would
cross the cap are dropped, never cut, so a role is never stored as a prefix of itself."""

from __future__ import annotations

from collections.abc import Iterable

MAX_ROLES_BYTES = 512


def _cleaned(roles: Iterable[str]) -> Iterable[str]:
    for role in roles:
        cleaned = role.replace(",", "").strip()
        if cleaned:
            yield cleaned


def flattened_size(roles: Iterable[str]) -> int:
    """The UTF-8 size of the roles flattened without a cap (what a token asks for)."""
    return len(",".join(_cleaned(roles)).encode("utf-8", "surrogatepass"))


def flatten_roles(roles: Iterable[str]) -> str | None:
    """Comma-join roles, dropping whole roles that would cross the 512-byte cap."""
    kept: list[str] = []
    size = 0
    for role in _cleaned(roles):
        extra = len(role.encode("utf-8", "surrogatepass")) + (1 if kept else 0)
        if size + extra > MAX_ROLES_BYTES:
            break
        kept.append(role)
        size += extra
    return ",".join(kept) or None


def split_roles(flattened: str | None) -> tuple[str, ...]:
    return tuple(r for r in (flattened or "").split(",") if r)
