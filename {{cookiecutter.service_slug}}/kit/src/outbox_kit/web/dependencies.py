"""FastAPI dependencies a context's routes use: the caller (401 without a valid token, 403 without
a role) and the unit-of-work factory."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from fastapi import HTTPException, Request, status

from ..application.unit_of_work import UnitOfWorkFactory
from ..kernel.request_context import RequestContext, current_context
from .http import TOKEN_ERROR_KEY


def authenticated(request: Request) -> RequestContext:
    """FastAPI dependency: the caller's context, or 401 with the reason."""
    context = current_context()
    if not context.is_authenticated or context.tenant_id is None:
        reason = request.scope.get("state", {}).get(TOKEN_ERROR_KEY, "a bearer token is required")
        raise HTTPException(
            status_code=status.HTTP_401_UNAUTHORIZED,
            detail=reason,
            headers={"WWW-Authenticate": "Bearer"},
        )
    return context


def require_role(role: str, *alternatives: str) -> Callable[[Request], RequestContext]:
    """FastAPI dependency factory: 401 without identity, 403 without ``role`` (or one of the
    ``alternatives``)."""
    accepted = (role, *alternatives)
    needed = f"role {role!r}" if not alternatives else f"one of the roles {', '.join(map(repr, accepted))}"

    def check(request: Request) -> RequestContext:
        context = authenticated(request)
        if not any(context.has_role(r) for r in accepted):
            raise HTTPException(status_code=status.HTTP_403_FORBIDDEN, detail=f"{needed} required")
        return context

    return check


def units_of_work(request: Request) -> UnitOfWorkFactory:
    """FastAPI dependency: the factory the composition root put on the app."""
    factory = getattr(request.app.state, "units_of_work", None)
    if not callable(factory):
        msg = "app.state.units_of_work is not set; build the app with entrypoints.app.create_app"
        raise TypeError(msg)
    return cast("UnitOfWorkFactory", factory)
