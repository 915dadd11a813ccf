"""What the orders context contributes to the service (discovered by the container)."""

from outbox_kit.public import HandlerRegistry, Module

from ...contracts import orders as contracts
from . import application
from .api import router
from .domain import OrderCancelled, OrderPlaced
from .infrastructure import SqlCustomerCounters, SqlOrders, SqlOrderSummaries
from .ports import CustomerCounters, Orders, OrderSummaries

# The example's flow the development banner offers first (``python -m <package> run``): place an
# order, then read what the notifications context recorded of it; the banner fills in the address
# and a development token (the banner's test checks every path named here is served).
BASE, AUTH = "{base}", "{auth}"
ORDER = '{"customer_id": "c-1", "lines": [{"sku": "BOOK", "quantity": 2, "unit_price": "9.99"}]}'


def register_handlers(handlers: HandlerRegistry) -> None:
    handlers.on_domain_event(OrderPlaced, application.project_order_placed)
    handlers.on_domain_event(OrderPlaced, application.announce_order_placed)
    handlers.on_domain_event(OrderCancelled, application.project_order_cancelled)
    handlers.on_domain_event(OrderCancelled, application.announce_order_cancelled)
    handlers.on_command(application.CountCustomerOrder, application.count_customer_order)


def module() -> Module:
    return Module(
        name="orders",
        messages=(OrderPlaced, OrderCancelled, application.CountCustomerOrder, *contracts.MESSAGES),
        register_handlers=register_handlers,
        routers=(router,),
        adapters={
            Orders: SqlOrders,
            OrderSummaries: SqlOrderSummaries,
            CustomerCounters: SqlCustomerCounters,
        },
        table_modules=(f"{__package__}.tables",),
        examples=(
            f"curl -s -X POST {BASE}/orders {AUTH} -H 'Content-Type: application/json' -d '{ORDER}'",
            f"curl -s {BASE}/notifications?order_id=<id> {AUTH}",  # what the consumer recorded of it
        ),
    )
