"""HTTP glue shared by every bounded context: the request context and error mapping.

:class:`RequestContextMiddleware` reads ``X-Correlation-Id`` (validated, generated when absent,
echoed on every response) and the bearer token, and sets the ambient request context for the
request. A bad token does not fail the request by itself; endpoints that need an identity depend
on :func:`authenticated`, which answers 401 with the reason.

The outbox rows a request writes carry a ``traceparent``: with tracing on, that of the server span
the OpenTelemetry FastAPI instrumentation opened around the request (see ``request_tracing``);
with tracing off, the caller's own, so a trace that started upstream runs on through this
service, or a fresh one, so every row can still be followed in the logs.
"""

from __future__ import annotations

import logging

from fastapi.responses import JSONResponse
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..kernel.context_values import (
    InvalidContextError,
    new_correlation_id,
    new_traceparent,
    validate_correlation_id,
    validate_traceparent,
)
from ..kernel.no_tracing import NoTracing
from ..kernel.request_context import RequestContext, use_context
from ..kernel.tracing import Tracing
from .auth import InvalidTokenError, TokenService

log = logging.getLogger(__name__)
CORRELATION_HEADER = "x-correlation-id"
TOKEN_ERROR_KEY = "token_error"  # noqa: S105 (a state key, not a secret)


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
        traceparent = self.tracing.active_traceparent() or incoming or new_traceparent()
        await self._handle(scope, receive, send, headers, correlation_id, traceparent)

    async def _handle(  # noqa: PLR0917 (one request's pieces, handed over once)
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        headers: dict[str, str],
        correlation_id: str,
        traceparent: str,
    ) -> None:
        context = RequestContext(correlation_id=correlation_id, traceparent=traceparent)
        authorization = headers.get("authorization", "")
        state = scope.setdefault("state", {})
        if authorization:
            scheme, _, token = authorization.partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                state[TOKEN_ERROR_KEY] = "Authorization must be 'Bearer <token>'"
            else:
                try:
                    identity = self.tokens.verify(token.strip())
                except InvalidTokenError as error:
                    state[TOKEN_ERROR_KEY] = str(error)
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
            await send(message)

        with use_context(context):
            await self.app(scope, receive, send_with_correlation)
