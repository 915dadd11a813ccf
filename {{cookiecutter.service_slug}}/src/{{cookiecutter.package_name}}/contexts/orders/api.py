"""HTTP routes of the orders context.

No ``from __future__ import annotations`` in route modules: FastAPI reads the annotations at
import time to build the dependency graph.
"""

from decimal import Decimal
from typing import Annotated

from fastapi import APIRouter, Depends, status
from pydantic import BaseModel, ConfigDict, Field

from ...building_blocks.public import (
    RequestContext,
    UnitOfWork,
    UnitOfWorkFactory,
    authenticated,
    units_of_work,
)
from . import application
from .domain import MAX_LINES, MAX_QUANTITY, Order, OrderLine

router = APIRouter(prefix="/orders", tags=["orders"])
Caller = Annotated[RequestContext, Depends(authenticated)]
Units = Annotated[UnitOfWorkFactory, Depends(units_of_work)]


class OrderLineIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sku: str = Field(min_length=1, max_length=64)
    quantity: int = Field(ge=1, le=MAX_QUANTITY)
    unit_price: Decimal = Field(ge=0, max_digits=12, decimal_places=2)


class PlaceOrderIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    customer_id: str = Field(min_length=1, max_length=128)
    lines: list[OrderLineIn] = Field(min_length=1, max_length=MAX_LINES)


class CancelOrderIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: str = Field(default="", max_length=500)


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


@router.post("", status_code=status.HTTP_201_CREATED)
async def place_order(body: PlaceOrderIn, _caller: Caller, units: Units) -> OrderOut:
    command = application.PlaceOrder(
        customer_id=body.customer_id,
        lines=tuple(OrderLine(line.sku, line.quantity, line.unit_price) for line in body.lines),
    )

    async def operation(uow: UnitOfWork) -> Order:
        return await application.place_order(uow, command)

    return OrderOut.of(await units().run(operation))


@router.get("/{order_id}")
async def get_order(order_id: str, _caller: Caller, units: Units) -> OrderOut:
    async with units() as uow:
        return OrderOut.of(await application.get_order(uow, order_id))


@router.post("/{order_id}/cancel")
async def cancel_order(
    order_id: str, _caller: Caller, units: Units, body: CancelOrderIn | None = None
) -> OrderOut:
    reason = body.reason if body else ""

    async def operation(uow: UnitOfWork) -> Order:
        return await application.cancel_order(uow, order_id, reason)

    return OrderOut.of(await units().run(operation))
