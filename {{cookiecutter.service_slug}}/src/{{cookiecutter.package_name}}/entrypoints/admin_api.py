"""Admin API for the outbox under ``/admin/outbox`` (role ``outbox-admin`` required).

A replay is recorded with the caller's identity (the token's subject), never a name the request
body could choose. An unknown id is 404, any other request an operator can fix is 400.
"""

from dataclasses import asdict
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from pydantic import BaseModel, Field

from ..building_blocks.context import RequestContext
from ..building_blocks.outbox.admin import (
    MAX_OFFSET,
    MAX_PAGE,
    AdminError,
    OutboxAdministration,
    RowNotFoundError,
)
from ..building_blocks.web import require_role


def build_admin_router(admin_role: str) -> APIRouter:
    router = APIRouter(prefix="/admin/outbox", tags=["admin"])
    Admin = Annotated[RequestContext, Depends(require_role(admin_role))]  # noqa: N806

    def administration(request: Request) -> OutboxAdministration:
        admin = request.app.state.outbox_admin
        assert isinstance(admin, OutboxAdministration)  # noqa: S101 (set by create_app)
        return admin

    Service = Annotated[OutboxAdministration, Depends(administration)]  # noqa: N806

    class ReplayIn(BaseModel):
        source: str = "outbox"
        ids: list[str] = Field(min_length=1, max_length=1000)

    def fail(error: AdminError) -> HTTPException:
        status = 404 if isinstance(error, RowNotFoundError) else 400
        return HTTPException(status_code=status, detail=str(error))

    @router.get("/dead-letters")
    async def list_dead_letters(
        _admin: Admin,
        service: Service,
        source: str | None = None,
        offset: Annotated[int, Query(ge=0, le=MAX_OFFSET)] = 0,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 50,
    ) -> list[dict[str, Any]]:
        try:
            return [asdict(d) for d in await service.list_dead_letters(source, offset=offset, limit=limit)]
        except AdminError as error:
            raise fail(error) from error

    @router.post("/dead-letters/replay")
    async def replay(body: ReplayIn, admin: Admin, service: Service) -> dict[str, Any]:
        try:
            result = await service.replay(body.source, body.ids, actor=admin.user_id or "unknown")
        except AdminError as error:
            raise fail(error) from error
        return asdict(result)

    @router.get("/pending")
    async def pending(_admin: Admin, service: Service, source: str | None = None) -> list[dict[str, Any]]:
        try:
            return [asdict(c) for c in await service.count_pending(source)]
        except AdminError as error:
            raise fail(error) from error

    @router.get("/{source}/{row_id}/explain")
    async def explain(source: str, row_id: str, _admin: Admin, service: Service) -> dict[str, Any]:
        try:
            return asdict(await service.explain(source, row_id))
        except AdminError as error:
            raise fail(error) from error

    return router
