"""Storage the notifications use cases need."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Protocol


@dataclass(frozen=True)
class Notification:
    """One delivered integration event, with the identity it ran under."""

    order_id: str
    event_name: str
    message_id: str
    tenant_id: str | None
    user_id: str | None
    correlation_id: str | None
    created_on: datetime


class Notifications(Protocol):
    """Notifications of the current tenant."""

    def record(self, notification: Notification) -> None: ...

    async def for_order(self, order_id: str) -> list[Notification]: ...
