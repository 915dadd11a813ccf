"""Reading a received message's headers without trusting them: each within its limit, all within a
total, the signature verified before anything is restored, identities without control
characters, an aware timestamp."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

from ..kernel.context_values import (
    InvalidContextError,
    validate_correlation_id,
    validate_traceparent,
)
from ..kernel.request_context import CapturedContext
from ..kernel.text import is_plain_identifier
from .envelope import Envelope
from .header_names import (
    CORRELATION_ID,
    EVENT_NAME,
    IDENTIFIER_HEADERS,
    LIMITS,
    MESSAGE_ID,
    OCCURRED_ON,
    TENANT_ID,
    TRACEPARENT,
    USER_ID,
    USER_ROLES,
)
from .rejections import RejectedMessageError, Rejection
from .signing import Signer


def read_envelope(
    raw_headers: Mapping[str, object], body: bytes, signer: Signer, *, max_header_bytes: int = 4096
) -> Envelope:
    """Validate headers (each within its limit, all within ``max_header_bytes``), verify the
    signature, and only then build the envelope."""
    headers = _bounded_headers(raw_headers, max_header_bytes)
    signer.verify(headers, body)
    for required in (MESSAGE_ID, EVENT_NAME):
        if not headers.get(required):
            raise RejectedMessageError(Rejection.MALFORMED_HEADER, f"{required} is missing")
    for name in IDENTIFIER_HEADERS:
        if not is_plain_identifier(headers.get(name, "")):
            # Stored in the inbox, restored as the caller, logged: the API's rule for claims.
            raise RejectedMessageError(Rejection.MALFORMED_HEADER, f"{name} holds a control character")
    return Envelope(
        message_id=headers[MESSAGE_ID],
        event_name=headers[EVENT_NAME],
        occurred_on=_occurred_on(headers),
        body=body,
        context=_context(headers),
    )


def _bounded_headers(raw_headers: Mapping[str, object], max_header_bytes: int) -> dict[str, str]:
    """Our headers as text, each within its own limit and all within ``max_header_bytes``."""
    headers: dict[str, str] = {}
    for name, limit in LIMITS.items():
        value = raw_headers.get(name)
        if value is None:
            continue
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        if not isinstance(value, str):
            raise RejectedMessageError(Rejection.MALFORMED_HEADER, f"{name} is not a string")
        try:
            size = len(value.encode())
        except UnicodeEncodeError as error:  # a lone surrogate (a JSON "\udcff" escape, say)
            raise RejectedMessageError(Rejection.MALFORMED_HEADER, f"{name} is not valid text") from error
        if size > limit:
            raise RejectedMessageError(Rejection.OVERSIZED_HEADER, f"{name} is longer than {limit} bytes")
        headers[name] = value
    total = sum(len(name) + len(value.encode()) for name, value in headers.items())
    if total > max_header_bytes:
        raise RejectedMessageError(
            Rejection.OVERSIZED_HEADER, f"the context headers take {total} bytes (limit {max_header_bytes})"
        )
    return headers


def _context(headers: Mapping[str, str]) -> CapturedContext:
    try:
        correlation = headers.get(CORRELATION_ID)
        return CapturedContext(
            tenant_id=headers.get(TENANT_ID) or None,
            user_id=headers.get(USER_ID) or None,
            user_roles=headers.get(USER_ROLES) or None,
            correlation_id=validate_correlation_id(correlation) if correlation else None,
            traceparent=validate_traceparent(headers.get(TRACEPARENT)),
        )
    except InvalidContextError as error:
        raise RejectedMessageError(Rejection.MALFORMED_HEADER, str(error)) from error


def _occurred_on(headers: Mapping[str, str]) -> datetime:
    try:
        occurred_on = datetime.fromisoformat(headers[OCCURRED_ON]) if OCCURRED_ON in headers else None
    except ValueError as error:
        raise RejectedMessageError(Rejection.MALFORMED_HEADER, str(error)) from error
    if occurred_on is None or occurred_on.tzinfo is None:
        raise RejectedMessageError(
            Rejection.MALFORMED_HEADER, f"{OCCURRED_ON} must be an aware ISO timestamp"
        )
    return occurred_on
