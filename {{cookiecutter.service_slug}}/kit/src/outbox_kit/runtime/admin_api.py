"""Admin API for the outbox under ``/admin/outbox``.

Two roles: ``outbox-admin`` (``AUTH__ADMIN_ROLE``) works within the token's tenant, so another
tenant's row answers 404 exactly like a row that does not exist; the operator role
(``AUTH__OPERATOR_ROLE``, ``outbox-operator``) sees and replays every tenant's rows, rows without
a tenant included. A replay is recorded with the caller's identity (the token's subject), never a
name the request body could choose. An unknown id is 404, any other request an operator can fix
is 400. A source or id that is not one by its shape (not a known table, not a UUID) is refused
by the schema itself (422), as the OpenAPI document says.
"""

import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from outbox_kit.application.context import RequestContext
from outbox_kit.operations.admin import RelayAdministration
from outbox_kit.operations.requests import (
    EVERY_TENANT,
    MAX_OFFSET,
    MAX_PAGE,
    AdminError,
    RowNotFoundError,
    TenantScope,
)
from outbox_kit.runtime.errors import error_responses
from outbox_kit.runtime.http import require_role


@dataclass(frozen=True)
class Administrator:
    """An admin API caller and the rows it may see."""

    context: RequestContext
    scope: TenantScope


# The polled tables an operator names; in a query, leaving it out means both.
Source = Literal["outbox", "internal_commands"]


class ReplayIn(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a field it does not know (a typo, an actor) is 422

    source: Source = "outbox"
    ids: list[uuid.UUID] = Field(min_length=1, max_length=1000)


def administration(request: Request) -> RelayAdministration:
    admin = request.app.state.outbox_admin
    assert isinstance(admin, RelayAdministration)  # noqa: S101 (set by create_app)
    return admin


Service = Annotated[RelayAdministration, Depends(administration)]


def fail(error: AdminError) -> HTTPException:
    status = 404 if isinstance(error, RowNotFoundError) else 400
    return HTTPException(status_code=status, detail=str(error))


def administrator_of(admin_role: str, operator_role: str) -> Callable[[Request], Administrator]:
    """The caller and its scope: every tenant for the operator role, its own for the admin role."""
    either_role = require_role(admin_role, operator_role)

    def administrator(request: Request) -> Administrator:
        context = either_role(request)
        if context.has_role(operator_role):
            return Administrator(context, EVERY_TENANT)
        return Administrator(context, TenantScope(context.tenant_id))

    return administrator


def build_admin_router(admin_role: str, operator_role: str) -> APIRouter:
    router = APIRouter(prefix="/admin/outbox", tags=["admin"], responses=error_responses(400, 401, 403))
    admin = Annotated[Administrator, Depends(administrator_of(admin_role, operator_role))]
    _add_dead_letter_routes(router, admin)
    _add_row_routes(router, admin)
    return router


def _add_dead_letter_routes(router: APIRouter, Admin: Any) -> None:  # noqa: N803, ANN401 (an Annotated alias)
    @router.get("/dead-letters")
    async def list_dead_letters(
        admin: Admin,
        service: Service,
        source: Source | None = None,
        offset: Annotated[int, Query(ge=0, le=MAX_OFFSET)] = 0,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 50,
    ) -> list[dict[str, Any]]:
        try:
            letters = await service.list_dead_letters(source, offset=offset, limit=limit, scope=admin.scope)
            return [asdict(d) for d in letters]
        except AdminError as error:
            raise fail(error) from error

    @router.post("/dead-letters/replay", responses=error_responses(404))
    async def replay(body: ReplayIn, admin: Admin, service: Service) -> dict[str, Any]:
        try:
            actor = admin.context.user_id or "unknown"
            ids = [str(row_id) for row_id in body.ids]
            result = await service.replay(body.source, ids, actor=actor, scope=admin.scope)
        except AdminError as error:
            raise fail(error) from error
        return asdict(result)


def _add_row_routes(router: APIRouter, Admin: Any) -> None:  # noqa: N803, ANN401 (an Annotated alias)
    @router.get("/pending")
    async def pending(admin: Admin, service: Service, source: Source | None = None) -> list[dict[str, Any]]:
        try:
            return [asdict(c) for c in await service.count_pending(source, scope=admin.scope)]
        except AdminError as error:
            raise fail(error) from error

    @router.get("/{source}/{row_id}/explain", responses=error_responses(404))
    async def explain(source: Source, row_id: uuid.UUID, admin: Admin, service: Service) -> dict[str, Any]:
        try:
            return asdict(await service.explain(source, str(row_id), scope=admin.scope))
        except AdminError as error:
            raise fail(error) from error
