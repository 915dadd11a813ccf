"""A row as the claim returns it: leased to this processor for one delivery attempt."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ..kernel.request_context import CapturedContext


@dataclass(frozen=True)
class ClaimedRow:
    """A row leased to this processor for one delivery attempt."""

    id: uuid.UUID
    seq: int
    name: str
    payload: dict[str, Any]
    ordering_key: str | None
    retry_count: int
    occurred_on: datetime
    locked_until: datetime
    tenant_id: str | None
    user_id: str | None
    user_roles: str | None
    correlation_id: str | None
    trace_context: str | None
    kind: str | None
    last_error: str | None = None

    def captured_context(self) -> CapturedContext:
        """The request context the row was written under, to restore for its delivery."""
        return CapturedContext(
            tenant_id=self.tenant_id,
            user_id=self.user_id,
            user_roles=self.user_roles,
            correlation_id=self.correlation_id,
            traceparent=self.trace_context,
        )
