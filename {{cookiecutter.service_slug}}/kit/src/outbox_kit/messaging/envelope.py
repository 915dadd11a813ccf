"""The wire form of an integration event and its signed context headers.

The headers it travels with are named in ``header_names``.

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

from ..kernel.request_context import CapturedContext
from .header_names import (
    CORRELATION_ID,
    EVENT_NAME,
    MESSAGE_ID,
    OCCURRED_ON,
    TENANT_ID,
    TRACEPARENT,
    USER_ID,
    USER_ROLES,
)


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
