"""The Order aggregate. Pure domain: standard library and ``outbox_kit.domain`` only.

Every change is an event applied to the state (``_raise`` -> ``@applies``), so the events are
the complete history of the aggregate. Invariants are checked before an event is raised: an
order has 1-100 lines, each with a SKU, a positive quantity and a non-negative price, a total of
at most ``MAX_TOTAL``, and a cancelled order cannot be cancelled again.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from enum import StrEnum

from outbox_kit.domain import AggregateRoot, DomainError, DomainEvent, applies

MAX_LINES = 100
MAX_QUANTITY = 10_000
# The largest total an order records (14 digits, 2 of them decimals: what the orders table and
# the read model hold). Each line may be valid while their sum is not, so it is a rule of its own.
MAX_TOTAL = Decimal("999999999999.99")


class OrderStatus(StrEnum):
    PLACED = "placed"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class OrderLine:
    sku: str
    quantity: int
    unit_price: Decimal

    @property
    def amount(self) -> Decimal:
        return self.unit_price * self.quantity


@dataclass(frozen=True, kw_only=True)
class OrderPlaced(DomainEvent, name="orders.domain.order-placed.v1", ordered=True):
    tenant_id: str
    customer_id: str
    lines: tuple[OrderLine, ...]


@dataclass(frozen=True, kw_only=True)
class OrderCancelled(DomainEvent, name="orders.domain.order-cancelled.v1", ordered=True):
    reason: str


class InvalidOrderError(DomainError):
    """The order breaks a business rule (answered as 422)."""

    def __init__(self, message: str, field: tuple[str | int, ...] | None = None) -> None:
        super().__init__(message, code="invalid", field=field)


class Order(AggregateRoot):
    """An order of one customer, in one tenant."""

    tenant_id: str
    customer_id: str
    lines: tuple[OrderLine, ...]
    status: OrderStatus
    cancel_reason: str | None

    def __init__(self, order_id: str, *, version: int = 0) -> None:
        super().__init__(order_id, version=version)
        self.tenant_id = ""
        self.customer_id = ""
        self.lines = ()
        self.status = OrderStatus.PLACED
        self.cancel_reason = None

    @classmethod
    def place(cls, order_id: str, *, tenant_id: str, customer_id: str, lines: tuple[OrderLine, ...]) -> Order:
        if not customer_id.strip():
            msg = "customer_id must not be blank"
            raise InvalidOrderError(msg, ("customer_id",))
        if not 1 <= len(lines) <= MAX_LINES:
            msg = f"an order needs 1 to {MAX_LINES} lines, got {len(lines)}"
            raise InvalidOrderError(msg, ("lines",))
        for number, line in enumerate(lines, start=1):
            if not line.sku.strip():
                msg = f"line {number}: sku must not be blank"
                raise InvalidOrderError(msg, ("lines", number - 1, "sku"))
            if not 1 <= line.quantity <= MAX_QUANTITY:
                msg = f"line {number}: quantity must be between 1 and {MAX_QUANTITY}"
                raise InvalidOrderError(msg, ("lines", number - 1, "quantity"))
            if line.unit_price < 0:
                msg = f"line {number}: unit_price must not be negative"
                raise InvalidOrderError(msg, ("lines", number - 1, "unit_price"))
        if sum(line.amount for line in lines) > MAX_TOTAL:
            msg = f"the order total must not exceed {MAX_TOTAL}"
            raise InvalidOrderError(msg, ("lines",))
        order = cls(order_id)
        order._raise(
            OrderPlaced(aggregate_id=order_id, tenant_id=tenant_id, customer_id=customer_id, lines=lines)
        )
        return order

    def cancel(self, reason: str) -> None:
        if self.status is OrderStatus.CANCELLED:
            msg = f"order {self.id} is already cancelled"
            raise DomainError(msg, code="already_cancelled")
        self._raise(OrderCancelled(aggregate_id=self.id, reason=reason.strip() or "no reason given"))

    @property
    def total(self) -> Decimal:
        return sum((line.amount for line in self.lines), Decimal(0))

    @applies(OrderPlaced)
    def _placed(self, event: OrderPlaced) -> None:
        self.tenant_id = event.tenant_id
        self.customer_id = event.customer_id
        self.lines = event.lines
        self.status = OrderStatus.PLACED

    @applies(OrderCancelled)
    def _cancelled(self, event: OrderCancelled) -> None:
        self.status = OrderStatus.CANCELLED
        self.cancel_reason = event.reason
