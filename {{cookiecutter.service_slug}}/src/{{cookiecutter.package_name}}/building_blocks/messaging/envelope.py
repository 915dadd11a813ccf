"""The wire form of an integration event and its signed context headers.

Every message carries ``x-message-id`` (the outbox row id: the inbox deduplicates on it on every
transport, Kafka included), ``x-event-name``, ``x-occurred-on``, ``x-tenant-id``, ``x-user-id``,
``x-user-roles``, ``x-correlation-id``, W3C ``traceparent`` and ``x-context-signature``.

The signature is ``<key id>:<hex HMAC-SHA256>`` over a canonical encoding of those headers and
the body, so a consumer can trust the tenant and user a message claims to run under: without
it, anyone able to publish to the broker could act as any tenant. Keys rotate through
``MESSAGE_BUS__SIGNING_KEYS`` (verify with every listed key id, sign with the active one). A
consumer verifies *before* it restores anything; a missing, unknown or wrong signature, an
oversized header or a malformed value is rejected with a reason and never processed.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from ..kernel.context_values import (
    MAX_CORRELATION_ID_LENGTH,
    MAX_ROLES_LENGTH,
    MAX_TENANT_LENGTH,
    MAX_USER_LENGTH,
)
from ..kernel.request_context import CapturedContext

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
    TENANT_ID: MAX_TENANT_LENGTH,
    USER_ID: MAX_USER_LENGTH,
    USER_ROLES: MAX_ROLES_LENGTH,
    CORRELATION_ID: MAX_CORRELATION_ID_LENGTH,
    TRACEPARENT: 55,
    SIGNATURE: 200,
}


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
