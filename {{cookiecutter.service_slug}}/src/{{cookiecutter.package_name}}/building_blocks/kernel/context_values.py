"""Context values from outside (a header, a token, a message) are validated, never cleaned: a
correlation id of at most 64 safe characters, a W3C traceparent. Roles are in ``roles``."""

from __future__ import annotations

import re
import secrets
import uuid

MAX_CORRELATION_ID_LENGTH = 64

MAX_TENANT_LENGTH = 64

MAX_USER_LENGTH = 128

_CORRELATION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:\-]{0,63}")

_TRACEPARENT = re.compile(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")


class InvalidContextError(ValueError):
    """A context value from outside (header, token, message) failed validation."""


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
