"""HTTP routes of the orders context.

No ``from __future__ import annotations`` in route modules: FastAPI reads the annotations at
import time to build the dependency graph.
"""

from decimal import Decimal
from typing import Annotated

from fastapi import APIRouter, Depends, Path, Response, status
from outbox_kit.public import (
    STORABLE_TEXT,
    IdempotencyKey,
    RequestContext,
    UnitOfWork,
    UnitOfWorkFactory,
    authenticated,
    error_responses,
    idempotency_key,
    idempotent_response,
    run_once,
    units_of_work,
)
from pydantic import BaseModel, ConfigDict, Field

from . import application
from .domain import MAX_LINES, MAX_QUANTITY, Order, OrderLine

router = APIRouter(prefix="/orders", tags=["orders"], responses=error_responses(401))
Caller = Annotated[RequestContext, Depends(authenticated)]
Units = Annotated[UnitOfWorkFactory, Depends(units_of_work)]
Key = Annotated[IdempotencyKey | None, Depends(idempotency_key)]
OrderId = Annotated[str, Path(min_length=1, max_length=64, pattern=STORABLE_TEXT)]
# A price is a decimal string ("9.99"): a JSON number cannot carry cents exactly. At most
# 999999.99 a unit, so 100 lines of 10,000 units stay within the order total the tables hold
# (MAX_TOTAL): every order the schema admits is one the domain accepts.
PRICE = r"^[0-9]{1,6}(\.[0-9]{1,2})?$"
# Not blank (the domain's rule: something left after str.strip()) and no NUL. The whitespace is
# spelled out (what str.isspace() holds), not \s, whose meaning differs between regex engines.
WHITESPACE = r"\t-\r\x1c-\x20\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
NOT_BLANK = rf"^[^\x00]*[^\x00{WHITESPACE}][^\x00]*$"


class OrderLineIn(BaseModel):
    model_config = ConfigDict(extra="forbid", regex_engine="python-re")

    sku: str = Field(min_length=1, max_length=64, pattern=NOT_BLANK)
    quantity: int = Field(ge=1, le=MAX_QUANTITY)
    unit_price: str = Field(pattern=PRICE, examples=["9.99"])


class PlaceOrderIn(BaseModel):
    model_config = ConfigDict(extra="forbid", regex_engine="python-re")

    customer_id: str = Field(min_length=1, max_length=128, pattern=NOT_BLANK)
    lines: list[OrderLineIn] = Field(min_length=1, max_length=MAX_LINES)


class CancelOrderIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: str = Field(default="", max_length=500, pattern=STORABLE_TEXT)


class OrderLineOut(BaseModel):
    sku: str
    quantity: int
    unit_price: str


class OrderOut(BaseModel):
    id: str
    status: str
    customer_id: str
    tenant_id: str
    lines: list[OrderLineOut]
    total: str
    version: int
    cancel_reason: str | None

    @classmethod
    def of(cls, order: Order) -> "OrderOut":
        return cls(
            id=order.id,
            status=order.status.value,
            customer_id=order.customer_id,
            tenant_id=order.tenant_id,
            lines=[
                OrderLineOut(sku=line.sku, quantity=line.quantity, unit_price=str(line.unit_price))
                for line in order.lines
            ],
            total=str(order.total),
            version=order.version,
            cancel_reason=order.cancel_reason,
        )


@router.post("", status_code=status.HTTP_201_CREATED, response_model=OrderOut)
async def place_order(body: PlaceOrderIn, _caller: Caller, units: Units, key: Key = None) -> Response:
    """Place an order. With an ``Idempotency-Key`` header a retry is safe: the same key and body
    answer the first answer (201, the same order) and place nothing; another body answers 422."""
    command = application.PlaceOrder(
        customer_id=body.customer_id,
        lines=tuple(OrderLine(line.sku, line.quantity, Decimal(line.unit_price)) for line in body.lines),
    )

    async def operation(uow: UnitOfWork) -> Order:
        return await application.place_order(uow, command)

    answer = await run_once(
        units,
        operation,
        present=lambda order: OrderOut.of(order).model_dump(mode="json"),
        key=key,
        request=body.model_dump(mode="json"),
        status_code=status.HTTP_201_CREATED,
    )
    return idempotent_response(answer)


@router.get("/{order_id}", responses=error_responses(404))
async def get_order(order_id: OrderId, _caller: Caller, units: Units) -> OrderOut:
    async with units() as uow:
        return OrderOut.of(await application.get_order(uow, order_id))


@router.post("/{order_id}/cancel", responses=error_responses(404, 409))
async def cancel_order(
    order_id: OrderId, _caller: Caller, units: Units, body: CancelOrderIn | None = None
) -> OrderOut:
    reason = body.reason if body else ""

    async def operation(uow: UnitOfWork) -> Order:
        return await application.cancel_order(uow, order_id, reason)

    return OrderOut.of(await units().run(operation))
