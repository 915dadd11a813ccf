"""``GET /notifications?order_id=...``: what the consumer recorded, for the caller's tenant."""

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Depends, Query
from outbox_kit.public import (
    STORABLE_TEXT,
    RequestContext,
    UnitOfWorkFactory,
    authenticated,
    error_responses,
    units_of_work,
)
from pydantic import BaseModel

from .ports import Notifications

router = APIRouter(prefix="/notifications", tags=["notifications"], responses=error_responses(401))


class NotificationOut(BaseModel):
    order_id: str
    event_name: str
    message_id: str
    tenant_id: str | None
    user_id: str | None
    correlation_id: str | None
    created_on: datetime


@router.get("")
async def list_notifications(
    order_id: Annotated[str, Query(min_length=1, max_length=64, pattern=STORABLE_TEXT)],
    _caller: Annotated[RequestContext, Depends(authenticated)],
    units: Annotated[UnitOfWorkFactory, Depends(units_of_work)],
) -> list[NotificationOut]:
    async with units() as uow:
        found = await uow.repository(Notifications).for_order(order_id)
    return [NotificationOut(**vars(n)) for n in found]
