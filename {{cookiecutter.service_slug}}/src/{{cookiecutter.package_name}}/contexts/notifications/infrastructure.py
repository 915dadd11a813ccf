"""The adapter of the notifications context (only the container wires it)."""

from __future__ import annotations

from outbox_kit.public import AdapterScope, current_context
from sqlmodel import col, select

from .ports import Notification
from .tables import NotificationRow


class SqlNotifications:
    """Notifications in the ``notifications`` table, scoped to the current tenant."""

    def __init__(self, scope: AdapterScope) -> None:
        self.scope = scope

    def record(self, notification: Notification) -> None:
        self.scope.session.add(
            NotificationRow(
                tenant_id=notification.tenant_id,
                order_id=notification.order_id,
                event_name=notification.event_name,
                message_id=notification.message_id,
                user_id=notification.user_id,
                correlation_id=notification.correlation_id,
                created_on=notification.created_on,
            )
        )

    async def for_order(self, order_id: str) -> list[Notification]:
        statement = (
            select(NotificationRow)
            .where(
                NotificationRow.order_id == order_id, NotificationRow.tenant_id == current_context().tenant_id
            )
            .order_by(col(NotificationRow.created_on))
        )
        rows = (await self.scope.session.exec(statement)).all()
        return [
            Notification(
                r.order_id, r.event_name, r.message_id, r.tenant_id, r.user_id, r.correlation_id, r.created_on
            )
            for r in rows
        ]
