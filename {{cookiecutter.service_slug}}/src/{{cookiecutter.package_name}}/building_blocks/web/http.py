"""HTTP glue shared by every bounded context: the request context and error mapping.

:class:`RequestContextMiddleware` reads ``X-Correlation-Id`` (validated, generated when absent,
echoed on every response) and the bearer token, and sets the ambient request context for the
request. A bad token does not fail the request by itself; endpoints that need an identity depend
on :func:`authenticated`, which answers 401 with the reason. Each request runs in a server span
(a no-op unless tracing is on) whose ``traceparent`` is what the outbox rows it writes carry.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any, cast

from fastapi import FastAPI, HTTPException, Request, status
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..application.unit_of_work import UnitOfWorkFactory
from ..domain.errors import ConcurrencyError, DomainError, NotFoundError
from ..kernel.request_context import (
    InvalidContextError,
    RequestContext,
    current_context,
    new_correlation_id,
    new_traceparent,
    use_context,
    validate_correlation_id,
    validate_traceparent,
)
from ..kernel.text import ECHO_LIMIT, shorten
from ..kernel.tracing import NoTracing, Span, SpanKind, Tracing
from .auth import InvalidTokenError, TokenService

log = logging.getLogger(__name__)
CORRELATION_HEADER = "x-correlation-id"
_TOKEN_ERROR = "token_error"  # noqa: S105 (a state key, not a secret)


class RequestContextMiddleware:
    """Pure ASGI middleware (works for streaming responses and keeps the contextvar scoped)."""

    def __init__(self, app: ASGIApp, tokens: TokenService, tracing: Tracing | None = None) -> None:
        self.app = app
        self.tokens = tokens
        self.tracing: Tracing = tracing or NoTracing()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            correlation_id = validate_correlation_id(headers.get(CORRELATION_HEADER) or new_correlation_id())
            incoming = validate_traceparent(headers.get("traceparent"))
        except InvalidContextError as error:
            # A fresh id on the refusal still lets the caller and the logs talk about it.
            headers_out = {CORRELATION_HEADER: new_correlation_id()}
            response = JSONResponse({"detail": str(error)}, status_code=400, headers=headers_out)
            await response(scope, receive, send)
            return
        method = str(scope.get("method", "GET"))
        attributes = {"http.request.method": method, "url.path": str(scope.get("path", ""))}
        with self.tracing.span(
            f"HTTP {method}", kind=SpanKind.SERVER, traceparent=incoming, attributes=attributes
        ) as span:
            await self._handle(scope, receive, send, headers, correlation_id, span)

    async def _handle(  # noqa: PLR0917 (one request's pieces, handed over once)
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        headers: dict[str, str],
        correlation_id: str,
        span: Span,
    ) -> None:
        traceparent = span.traceparent or new_traceparent()
        context = RequestContext(correlation_id=correlation_id, traceparent=traceparent)
        authorization = headers.get("authorization", "")
        state = scope.setdefault("state", {})
        if authorization:
            scheme, _, token = authorization.partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                state[_TOKEN_ERROR] = "Authorization must be 'Bearer <token>'"
            else:
                try:
                    identity = self.tokens.verify(token.strip())
                except InvalidTokenError as error:
                    state[_TOKEN_ERROR] = str(error)
                else:
                    context = RequestContext(
                        tenant_id=identity.tenant_id,
                        user_id=identity.user_id,
                        roles=identity.roles,
                        correlation_id=correlation_id,
                        traceparent=traceparent,
                        authentication_type="bearer",
                    )

        async def send_with_correlation(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).append(CORRELATION_HEADER, correlation_id)
                span.set_attribute("http.response.status_code", int(message["status"]))
            await send(message)

        with use_context(context):
            await self.app(scope, receive, send_with_correlation)


def authenticated(request: Request) -> RequestContext:
    """FastAPI dependency: the caller's context, or 401 with the reason."""
    context = current_context()
    if not context.is_authenticated or context.tenant_id is None:
        reason = request.scope.get("state", {}).get(_TOKEN_ERROR, "a bearer token is required")
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


def install_error_handlers(app: FastAPI) -> None:
    """Domain errors become JSON problems with stable codes, never tracebacks."""

    async def domain_error(_request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, DomainError)  # noqa: S101 (registered for DomainError only)
        code = status.HTTP_409_CONFLICT
        if isinstance(error, NotFoundError):
            code = status.HTTP_404_NOT_FOUND
        elif not isinstance(error, ConcurrencyError) and error.code == "invalid":
            code = status.HTTP_422_UNPROCESSABLE_CONTENT
        if error.field is not None:  # shaped like FastAPI's own validation errors
            detail = [{"loc": ["body", *error.field], "msg": error.message, "type": error.code}]
            return JSONResponse({"detail": detail, "code": error.code}, status_code=code)
        return JSONResponse({"detail": error.message, "code": error.code}, status_code=code)

    async def validation_error(_request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, RequestValidationError)  # noqa: S101 (registered for it only)
        detail = [_with_short_input(e) for e in jsonable_encoder(error.errors())]
        return JSONResponse({"detail": detail}, status_code=status.HTTP_422_UNPROCESSABLE_CONTENT)

    app.add_exception_handler(DomainError, domain_error)
    app.add_exception_handler(RequestValidationError, validation_error)


def _with_short_input(error: dict[str, Any]) -> dict[str, Any]:
    """FastAPI's validation error with ``input`` cut to a short prefix: a refused megabyte (or,
    for a missing field, the whole body) is not sent back to the caller."""
    if "input" not in error:
        return error
    return {**error, "input": short_echo(error["input"])}


def short_echo(value: object) -> object:
    """``value`` itself when its JSON form is short, else the start of that JSON form."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return value if len(text) <= ECHO_LIMIT else shorten(text)


def units_of_work(request: Request) -> UnitOfWorkFactory:
    """FastAPI dependency: the factory the composition root put on the app."""
    factory = getattr(request.app.state, "units_of_work", None)
    if not callable(factory):
        msg = "app.state.units_of_work is not set; build the app with entrypoints.app.create_app"
        raise TypeError(msg)
    return cast("UnitOfWorkFactory", factory)
