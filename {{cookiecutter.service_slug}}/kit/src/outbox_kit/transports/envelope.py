"""The envelope on the wire: an integration event's body and its signed context headers, how they
are signed, how a received message is read back without trusting it, and why one is rejected.

**The headers.** Every message carries ``x-message-id`` (the outbox row id: the inbox
deduplicates on it on every transport, Kafka included), ``x-event-name``, ``x-occurred-on``,
``x-tenant-id``, ``x-user-id``, ``x-user-roles``, ``x-correlation-id``, W3C ``traceparent`` and
``x-context-signature``. The limits, in UTF-8 bytes, are checked before anything is restored: an
oversized header is a rejection, not a truncation, because a truncated tenant or user is a
different tenant or user. The identity limits are the constants the API bounds a token's claims
with, so a caller the API accepts is never refused here.

**The signature** is ``<key id>:<hex HMAC-SHA256>`` over a canonical encoding of the signed
headers and the body, so a consumer can trust the tenant and user a message claims to run under:
without it, anyone able to publish to the broker could act as any tenant. Keys rotate through
``MESSAGE_BUS__SIGNING_KEYS`` (every listed key id verifies, the active one signs).

**Reading a message back** trusts nothing: each header within its limit, all within a total, the
signature verified *before* anything is restored, identities without control characters, an
aware timestamp. A missing, unknown or wrong signature, an oversized header or a malformed value
is a :class:`RejectedMessageError` with a short stable reason tag (for metrics and dead-letter
copies): the transport dead-letters such a message at once and never retries it."""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from outbox_kit.application.context import (
    MAX_CORRELATION_ID_BYTES,
    MAX_ROLES_BYTES,
    MAX_TENANT_BYTES,
    MAX_USER_BYTES,
    CapturedContext,
    InvalidContextError,
    RequestContext,
    check_roles,
    restored,
    validate_correlation_id,
    validate_traceparent,
)
from outbox_kit.application.text import is_plain_identifier


class Rejection(StrEnum):
    """Why a message is dead-lettered without being processed (stable tags for metrics)."""

    UNSIGNED = "unsigned"
    BAD_SIGNATURE = "bad_signature"
    MALFORMED_HEADER = "malformed_header"
    OVERSIZED_HEADER = "oversized_header"
    MALFORMED_BODY = "malformed_body"
    UNKNOWN_EVENT = "unknown_event"
    UNEXPECTED_EVENT = "unexpected_event"
    STALE = "stale"  # older than the inbox remembers (see consume/inbox.py)
    # A processed message id arriving again with another signed body (see consume/inbox.py).
    CONFLICTING_DUPLICATE = "conflicting_duplicate"


class RejectedMessageError(ValueError):
    """The message cannot be trusted or read; ``reason`` is a short stable tag."""

    def __init__(self, reason: Rejection, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


MESSAGE_ID = "x-message-id"
EVENT_NAME = "x-event-name"
OCCURRED_ON = "x-occurred-on"
TENANT_ID = "x-tenant-id"
USER_ID = "x-user-id"
USER_ROLES = "x-user-roles"
CORRELATION_ID = "x-correlation-id"
TRACEPARENT = "traceparent"
SIGNATURE = "x-context-signature"
SIGNED_HEADERS = (
    MESSAGE_ID,
    EVENT_NAME,
    OCCURRED_ON,
    TENANT_ID,
    USER_ID,
    USER_ROLES,
    CORRELATION_ID,
    TRACEPARENT,
)
IDENTIFIER_HEADERS = (MESSAGE_ID, EVENT_NAME, TENANT_ID, USER_ID, USER_ROLES)
LIMITS = {
    MESSAGE_ID: 128,
    EVENT_NAME: 200,
    OCCURRED_ON: 64,
    TENANT_ID: MAX_TENANT_BYTES,
    USER_ID: MAX_USER_BYTES,
    USER_ROLES: MAX_ROLES_BYTES,
    CORRELATION_ID: MAX_CORRELATION_ID_BYTES,
    TRACEPARENT: 55,
    SIGNATURE: 200,
}


def body_of(payload: Mapping[str, object]) -> bytes:
    """The body a message travels with: its payload as canonical JSON (keys sorted, no spaces).

    Computed from the stored payload as it is, never re-encoded through the event's class: a
    class that changed between two publishes of one row (an optional field added, a default
    changed) would make the copies differ, and the consumer's inbox, which compares the body's
    digest, would take the second copy for a conflict. Canonical, because PostgreSQL's JSONB
    keeps neither key order nor spacing: the body of a row is the same on every publish, on
    SQLite and on PostgreSQL."""
    return json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Envelope:
    """An integration event ready for (or just received from) a transport."""

    message_id: str
    event_name: str
    occurred_on: datetime
    body: bytes
    context: CapturedContext
    ordering_key: str | None = None

    def headers(self) -> dict[str, str]:
        """Transport headers (every value a ``str``: NATS and Redis refuse anything else)."""
        values = {
            MESSAGE_ID: self.message_id,
            EVENT_NAME: self.event_name,
            OCCURRED_ON: self.occurred_on.isoformat(),
            TENANT_ID: self.context.tenant_id or "",
            USER_ID: self.context.user_id or "",
            USER_ROLES: self.context.user_roles or "",
            CORRELATION_ID: self.context.correlation_id or "",
            TRACEPARENT: self.context.traceparent or "",
        }
        return {k: v for k, v in values.items() if v}


CLOUD_EVENTS_VERSION = "1.0"
CLOUD_EVENT_ATTRIBUTES = ("specversion", "id", "type", "source", "time", "tenantid", "correlationid")


def cloud_event_headers(envelope: Envelope, *, source: str, prefix: str) -> dict[str, str]:
    """The envelope as a CloudEvent in binary mode, for consumers written in other languages
    with a CloudEvents SDK: ``specversion``, ``id`` (the message id), ``type`` (the event name),
    ``source``, ``time`` (when it occurred) and the extensions ``tenantid`` and
    ``correlationid``, each a header named ``prefix`` + attribute (``ce-``, or ``ce_`` as the
    Kafka binding has it), and ``content-type: application/json``; the body is the event's JSON
    data. Beside the signed headers, not
    signed themselves: this service's consumers read only the signed ones."""
    attributes = {
        "specversion": CLOUD_EVENTS_VERSION,
        "id": envelope.message_id,
        "type": envelope.event_name,
        "source": source,
        "time": envelope.occurred_on.isoformat(),
        "tenantid": envelope.context.tenant_id or "",
        "correlationid": envelope.context.correlation_id or "",
    }
    headers = {f"{prefix}{name}": value for name, value in attributes.items() if value}
    # Binary mode maps ``datacontenttype`` to the protocol's own content type (FastStream leaves
    # it empty for a bytes body on Kafka and NATS, which a CloudEvents reader refuses).
    headers["content-type"] = "application/json"
    return headers


def _canonical(headers: Mapping[str, str], body: bytes) -> bytes:
    signed = [[name, headers.get(name, "")] for name in SIGNED_HEADERS]
    return json.dumps(signed, separators=(",", ":")).encode() + b"\n" + body


class Signer:
    """Signs outgoing and verifies incoming headers with a rotating set of HMAC keys."""

    def __init__(self, keys: Mapping[str, str], active_key_id: str | None, *, allow_unsigned: bool) -> None:
        self._keys = {kid: secret.encode() for kid, secret in keys.items()}
        self._active = active_key_id
        self.allow_unsigned = allow_unsigned

    @property
    def signs(self) -> bool:
        return self._active is not None

    def sign(self, headers: dict[str, str], body: bytes) -> dict[str, str]:
        if self._active is None:
            return headers
        digest = hmac.new(self._keys[self._active], _canonical(headers, body), hashlib.sha256)
        return headers | {SIGNATURE: f"{self._active}:{digest.hexdigest()}"}

    def verify(self, headers: Mapping[str, str], body: bytes) -> None:
        signature = headers.get(SIGNATURE)
        if not signature:
            if self._keys and not self.allow_unsigned:
                raise RejectedMessageError(Rejection.UNSIGNED, "the message has no x-context-signature")
            return
        kid, sep, hex_digest = signature.partition(":")
        key = self._keys.get(kid)
        if not sep or key is None:
            raise RejectedMessageError(Rejection.BAD_SIGNATURE, f"unknown signing key id {kid!r}")
        expected = hmac.new(key, _canonical(headers, body), hashlib.sha256).hexdigest().encode()
        # Bytes: compare_digest refuses a str with non-ASCII characters (TypeError), and a digest
        # that is not hex is a bad signature like any other, not a handler failure to retry.
        if not hmac.compare_digest(expected, hex_digest.encode()):
            raise RejectedMessageError(Rejection.BAD_SIGNATURE, "the signature does not match")

    def __repr__(self) -> str:
        """The key ids only: a signer is a frame variable of every verification (error reports)."""
        return f"Signer(key_ids={sorted(self._keys)!r}, active={self._active!r})"


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


MESSAGE_AUTHENTICATION = "message"  # how a context restored from a message was authenticated
ANONYMOUS = CapturedContext(None, None, None, None, None)


@contextmanager
def claimed_context(raw_headers: Mapping[str, object]) -> Iterator[RequestContext]:
    """Run a block under the correlation id and tenant a received message's headers claim, so
    its log lines carry them from the moment it arrives (before it is verified); headers too
    malformed to read give a fresh context (its own correlation id), never the worker's. Never
    trusted beyond the logs: no user, no roles; the pipeline restores the verified context for
    the handler."""
    captured = _claimed(raw_headers) or ANONYMOUS
    with restored(captured, authentication_type=MESSAGE_AUTHENTICATION) as context:
        yield context


def _claimed(raw_headers: Mapping[str, object]) -> CapturedContext | None:
    try:
        headers = _bounded_headers(raw_headers, sum(LIMITS.values()))
        tenant = headers.get(TENANT_ID) or None
        if tenant is not None and not is_plain_identifier(tenant):
            return None
        context = _context(headers)
    except RejectedMessageError:
        return None
    return CapturedContext(
        tenant_id=tenant,
        user_id=None,
        user_roles=None,
        correlation_id=context.correlation_id,
        traceparent=None,
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
        roles = headers.get(USER_ROLES) or None
        if roles:  # refused where it enters, as at the API: the consumer's commit would refuse it later
            check_roles(roles.split(","))
        return CapturedContext(
            tenant_id=headers.get(TENANT_ID) or None,
            user_id=headers.get(USER_ID) or None,
            user_roles=roles,
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
