"""Who is asking: the request context, its bounded values, and how it crosses a hop.

Context values from outside (a header, a token, a message) are validated, never cleaned: a
correlation id of at most 64 safe characters, a W3C traceparent, a tenant and a user within their
limits. Roles are in ``roles``.

Identities are bounded in one unit, UTF-8 bytes, the unit a signed header is bounded in: the same
constants bound the token's claims at the API, the ambient context where it becomes a row
(:func:`check_identity`), and the headers every consumer reads (``transports/envelope.py``).
A value within them is never refused downstream; the columns that store these values are
``varchar(n)`` with ``n`` at least the limit (``n`` counts characters, and ``n`` bytes are never
more than ``n`` characters).

Roles travel flattened: one comma-joined text of at most 512 bytes in UTF-8 (the unit the
``x-user-roles`` header is bounded in), in a header and in an outbox column. A role that form
would not carry back unchanged (a comma, whitespace at either end, empty) is refused wherever it
enters, by the one check :func:`check_roles` (the API's token, the ``token`` command, a captured
context), so the role a consumer restores is the role the API checked. A token whose roles
flatten to more is refused at the API; for a context set by other means, whole roles that would
cross the cap are dropped, never cut, so a role is never stored as a prefix of itself.

Who is acting, for which tenant, under which correlation: the ambient request context.

The API sets it from the bearer token and the ``X-Correlation-Id`` header; every asynchronous hop
(outbox row, internal command, broker message) captures it when written and restores it when
delivered, through the one pair of helpers below, so the hops cannot drift apart. A restore
always *replaces* the whole context (never merges), so one row's identity can never answer for
the next row of the same batch.

The asynchronous hops (an outbox row, an internal command, a broker message) capture the ambient
context when written and restore it when delivered, through this one pair of helpers, so the
hops cannot drift apart. A restore always replaces the whole context (never merges), so one
row's identity can never answer for the next row of the same batch."""

from __future__ import annotations

import re
import secrets
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

from outbox_kit.application.text import shorten

MAX_CORRELATION_ID_BYTES = 64  # ASCII only (see the pattern): as many characters

MAX_TENANT_BYTES = 64

MAX_USER_BYTES = 128

_CORRELATION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:\-]{0,63}")

_TRACEPARENT = re.compile(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")


class InvalidContextError(ValueError):
    """A context value from outside (header, token, message) failed validation."""


def utf8_size(text: str) -> int:
    """The size of ``text`` in UTF-8 (a lone surrogate counted as its 3 bytes, never an error)."""
    return len(text.encode("utf-8", "surrogatepass"))


def fits(text: str, limit: int) -> bool:
    """True for a non-empty ``text`` of at most ``limit`` bytes in UTF-8."""
    return 0 < utf8_size(text) <= limit


def check_identity(tenant_id: str | None, user_id: str | None) -> None:
    """Refuse a tenant or user over its byte limit: every consumer would refuse the header that
    carries it (``oversized_header``), so each event of that caller would be lost to them."""
    for name, value, limit in (("tenant", tenant_id, MAX_TENANT_BYTES), ("user", user_id, MAX_USER_BYTES)):
        if value is not None and not fits(value, limit):
            msg = f"the {name} must be 1-{limit} bytes in UTF-8, got {utf8_size(value)}"
            raise InvalidContextError(msg)


def new_correlation_id() -> str:
    return uuid.uuid4().hex


def new_traceparent() -> str:
    """A fresh W3C trace context (used when no tracer supplied one)."""
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"


def validate_correlation_id(value: str) -> str:
    """Accept at most 64 characters from a safe set; anything else is refused, not cleaned."""
    if not _CORRELATION_ID.fullmatch(value):
        msg = (
            "X-Correlation-Id must be 1-64 characters of letters, digits, '.', '_', ':' or '-', "
            "starting with a letter or digit"
        )
        raise InvalidContextError(msg)
    return value


def validate_traceparent(value: str | None) -> str | None:
    if value is None or value == "":
        return None
    if not _TRACEPARENT.fullmatch(value):
        msg = "traceparent is not a W3C trace context (00-<32 hex>-<16 hex>-<2 hex>)"
        raise InvalidContextError(msg)
    return value


MAX_ROLES_BYTES = 512


def check_roles(roles: Iterable[str]) -> tuple[str, ...]:
    """``roles`` unchanged, when each is what the flattened form carries back as it is: not
    empty, no comma, no whitespace at either end. Otherwise :class:`InvalidContextError`: a role
    is refused where it enters, never cleaned after it was checked (``"outbox-admin "``, refused
    by an exact check at the API, would come back as ``outbox-admin`` to every consumer)."""
    checked = tuple(roles)
    for role in checked:
        if not role or role != role.replace(",", "").strip():
            msg = (
                "a role must be non-empty, without a comma and without whitespace at either end, "
                f"got {shorten(role)!r}"
            )
            raise InvalidContextError(msg)
    return checked


def flattened_size(roles: Iterable[str]) -> int:
    """The UTF-8 size of the roles flattened without a cap (what a token asks for)."""
    return utf8_size(",".join(check_roles(roles)))


def flatten_roles(roles: Iterable[str]) -> str | None:
    """Comma-join roles (each checked: :func:`check_roles`), dropping whole roles that would
    cross the 512-byte cap."""
    kept: list[str] = []
    size = 0
    for role in check_roles(roles):
        extra = utf8_size(role) + (1 if kept else 0)
        if size + extra > MAX_ROLES_BYTES:
            break
        kept.append(role)
        size += extra
    return ",".join(kept) or None


def split_roles(flattened: str | None) -> tuple[str, ...]:
    return tuple(r for r in (flattened or "").split(",") if r)


@dataclass(frozen=True, slots=True)
class RequestContext:
    """The identity and correlation a piece of work runs under."""

    tenant_id: str | None = None
    user_id: str | None = None
    roles: tuple[str, ...] = ()
    correlation_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    traceparent: str | None = None
    authentication_type: str | None = None

    @property
    def is_authenticated(self) -> bool:
        return self.user_id is not None

    def has_role(self, role: str) -> bool:
        return role in self.roles


@dataclass(frozen=True, slots=True)
class CapturedContext:
    """The persisted form of a context: what an outbox row, a command or a header carries."""

    tenant_id: str | None
    user_id: str | None
    user_roles: str | None
    correlation_id: str | None
    traceparent: str | None


_current: ContextVar[RequestContext | None] = ContextVar("request_context", default=None)


def current_context() -> RequestContext:
    """The ambient context; an anonymous one (with a fresh correlation id) when none is set."""
    context = _current.get()
    if context is None:
        context = RequestContext()
        _current.set(context)
    return context


@contextmanager
def use_context(context: RequestContext) -> Iterator[RequestContext]:
    """Run a block under ``context``, replacing (not merging) whatever was ambient."""
    token = _current.set(context)
    try:
        yield context
    finally:
        _current.reset(token)


def capture_context() -> CapturedContext:
    """Snapshot the ambient context for persistence (roles checked, flattened and capped); an
    identity over its byte limit or a role the flattened form would change is refused
    (``InvalidContextError``) before any row carries it."""
    context = current_context()
    check_identity(context.tenant_id, context.user_id)
    return CapturedContext(
        tenant_id=context.tenant_id,
        user_id=context.user_id,
        user_roles=flatten_roles(context.roles),
        correlation_id=context.correlation_id,
        traceparent=context.traceparent,
    )


def rebuild(captured: CapturedContext, *, authentication_type: str) -> RequestContext:
    """Turn a captured context back into a live one, naming the hop it came back from."""
    return RequestContext(
        tenant_id=captured.tenant_id,
        user_id=captured.user_id,
        roles=split_roles(captured.user_roles),
        correlation_id=captured.correlation_id or new_correlation_id(),
        traceparent=captured.traceparent,
        authentication_type=authentication_type if captured.user_id else None,
    )


@contextmanager
def restored(captured: CapturedContext, *, authentication_type: str) -> Iterator[RequestContext]:
    """Restore a captured context for one delivery (outbox row, command or message)."""
    with use_context(rebuild(captured, authentication_type=authentication_type)) as context:
        yield context
