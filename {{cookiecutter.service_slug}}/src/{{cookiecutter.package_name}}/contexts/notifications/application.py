"""Integration-event handlers of the notifications context.

They run inside the consume pipeline, which has already verified the message, restored the
sender's tenant, user and correlation, and staged the inbox row; the handler only records the
notification (it does not save: the pipeline commits the notification and the inbox row
together, which is what makes a redelivered message a no-op).
"""

from __future__ import annotations

from outbox_kit.public import UnitOfWork, current_context, current_delivery

from ...contracts.orders import OrderCancelledV1, OrderPlacedV1
from .ports import Notification, Notifications


def _record(uow: UnitOfWork, order_id: str) -> None:
    delivery = current_delivery()
    context = current_context()
    uow.repository(Notifications).record(
        Notification(
            order_id=order_id,
            event_name=delivery.event_name,
            message_id=delivery.message_id,
            tenant_id=context.tenant_id,
            user_id=context.user_id,
            correlation_id=context.correlation_id,
            created_on=uow.now,
        )
    )


async def on_order_placed(event: OrderPlacedV1, uow: UnitOfWork) -> None:
    _record(uow, event.order_id)


async def on_order_cancelled(event: OrderCancelledV1, uow: UnitOfWork) -> None:
    _record(uow, event.order_id)
