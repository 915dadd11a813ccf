"""The header names every integration message carries, which of them are signed, and their limits.

Every message carries ``x-message-id`` (the outbox row id: the inbox deduplicates on it on every
transport, Kafka included), ``x-event-name``, ``x-occurred-on``, ``x-tenant-id``, ``x-user-id``,
``x-user-roles``, ``x-correlation-id``, W3C ``traceparent`` and ``x-context-signature``. The
limits, in UTF-8 bytes, are checked before anything is restored: an oversized header is a
rejection, not a truncation, because a truncated tenant or user is a different tenant or user.
The identity limits are the constants the API bounds a token's claims with, so a caller the API
accepts is never refused here.
"""

from __future__ import annotations

from ..kernel.context_values import MAX_CORRELATION_ID_BYTES, MAX_TENANT_BYTES, MAX_USER_BYTES
from ..kernel.roles import MAX_ROLES_BYTES

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
