"""Context values from outside (a header, a token, a message) are validated, never cleaned: a
correlation id of at most 64 safe characters, a W3C traceparent, a tenant and a user within their
limits. Roles are in ``roles``.

Identities are bounded in one unit, UTF-8 bytes, the unit a signed header is bounded in: the same
constants bound the token's claims at the API, the ambient context where it becomes a row
(:func:`check_identity`), and the headers every consumer reads (``messaging/header_names.py``).
A value within them is never refused downstream; the columns that store these values are
``varchar(n)`` with ``n`` at least the limit (``n`` counts characters, and ``n`` bytes are never
more than ``n`` characters).
"""

from __future__ import annotations

import re
import secrets
import uuid

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
