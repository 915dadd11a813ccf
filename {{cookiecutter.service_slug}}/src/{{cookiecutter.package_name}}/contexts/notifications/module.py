"""What the notifications context contributes (discovered by the container)."""

from outbox_kit.public import HandlerRegistry, Module

from ...contracts import orders as contracts
from . import application
from .api import router
from .infrastructure import SqlNotifications
from .ports import Notifications


def register_handlers(handlers: HandlerRegistry) -> None:
    handlers.consume("notifications.order-placed", contracts.OrderPlacedV1, application.on_order_placed)
    handlers.consume(
        "notifications.order-cancelled", contracts.OrderCancelledV1, application.on_order_cancelled
    )


def module() -> Module:
    return Module(
        name="notifications",
        messages=contracts.MESSAGES,
        register_handlers=register_handlers,
        routers=(router,),
        table_modules=(f"{__package__}.tables",),
        adapters={Notifications: SqlNotifications},
    )
