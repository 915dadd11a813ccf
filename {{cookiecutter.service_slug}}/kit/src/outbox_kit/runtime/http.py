"""The request as routes see it: its context, its span, and the FastAPI dependencies they use.

:class:`RequestContextMiddleware` reads ``X-Correlation-Id`` (validated, generated when absent,
echoed on every response) and the bearer token, and sets the ambient request context for the
request. A bad token does not fail the request by itself; endpoints that need an identity depend
on :func:`authenticated`, which answers 401 with the reason (403 without a role:
:func:`require_role`); :func:`units_of_work` gives a route its context's unit-of-work factory.

The outbox rows a request writes carry a ``traceparent``: with tracing on, that of the server span
the OpenTelemetry FastAPI instrumentation opened around the request (:func:`trace_requests`: each
span named after the route template, the probes and ``/metrics`` left out); with tracing off,
the caller's own, so a trace that started upstream runs on through this service, or a fresh one,
so every row can still be followed in the logs.

The ``Idempotency-Key`` header of a create command, and its answer: a route takes
``key: Annotated[IdempotencyKey | None, Depends(idempotency_key)]``, runs its command through
``run_once(units, operation, key=key, request=..., status_code=201)`` and returns
``idempotent_response(answer)``: the first answer's status and exact bytes, with
``Idempotent-Replayed: true`` when it is a repeat.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, cast

from fastapi import Depends, FastAPI, Header, HTTPException, Request, Response, status
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from outbox_kit.application.context import (
    InvalidContextError,
    RequestContext,
    current_context,
    new_correlation_id,
    new_traceparent,
    use_context,
    validate_correlation_id,
    validate_traceparent,
)
from outbox_kit.application.error_tracking import tag_error_reports
from outbox_kit.application.tracing import NoTracing, Tracing
from outbox_kit.application.unit_of_work import UnitOfWorkFactory
from outbox_kit.persistence.idempotency import Answer, IdempotencyKey
from outbox_kit.runtime.identity_provider import InvalidTokenError, KeysUnavailableError
from outbox_kit.runtime.tokens import TokenService

UNTRACED_PATHS = ("/livez", "/readyz", "/metrics")


def trace_requests(app: FastAPI, tracing: Tracing) -> None:
    """Open a server span around every request of ``app`` when tracing is on."""
    if tracing.tracer_provider is None:
        return
    try:
        from opentelemetry.instrumentation.fastapi import (  # noqa: PLC0415 (optional dependency)
            FastAPIInstrumentor,
        )
    except ImportError as missing:
        msg = "TELEMETRY__TRACING=otel needs the FastAPI instrumentation: pip install '.[otel]'"
        raise RuntimeError(msg) from missing
    FastAPIInstrumentor.instrument_app(
        app,
        tracer_provider=tracing.tracer_provider,
        # matched against the whole URL (scheme, host and path, no query)
        excluded_urls=",".join(f"://[^/]+{path}$" for path in UNTRACED_PATHS),
        exclude_spans=["receive", "send"],
    )


CORRELATION_HEADER = "x-correlation-id"
TOKEN_ERROR_KEY = "token_error"  # noqa: S105 (a state key, not a secret)
TOKEN_STATUS_KEY = "token_status"  # noqa: S105 (a state key, not a secret)


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
                client = scope.get("client")
                host = client[0] if client else None
                try:
                    identity = await self.tokens.authenticate(token.strip(), client_host=host)
                except InvalidTokenError as error:
                    state[TOKEN_ERROR_KEY] = str(error)
                    state[TOKEN_STATUS_KEY] = 503 if isinstance(error, KeysUnavailableError) else 401
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

        tag_error_reports(context)
        with use_context(context):
            await self.app(scope, receive, send_with_correlation)


# Declares the scheme in the OpenAPI document (``/docs`` gets its Authorize button); the
# middleware above has already read the header.
BEARER = HTTPBearer(
    auto_error=False,
    bearerFormat="JWT",
    description="A JWT from the identity provider, or in development one from `python -m <package> token`.",
)
Bearer = Annotated[HTTPAuthorizationCredentials | None, Depends(BEARER)]
KEYS_RETRY_AFTER_SECONDS = 5


def authenticated(request: Request, _bearer: Bearer = None) -> RequestContext:
    """FastAPI dependency: the caller's context, or 401 with the reason (503 while the identity
    provider's keys cannot be fetched)."""
    context = current_context()
    if not context.is_authenticated or context.tenant_id is None:
        state = request.scope.get("state", {})
        reason = state.get(TOKEN_ERROR_KEY, "a bearer token is required")
        if state.get(TOKEN_STATUS_KEY) == status.HTTP_503_SERVICE_UNAVAILABLE:
            raise HTTPException(
                status_code=status.HTTP_503_SERVICE_UNAVAILABLE,
                detail=reason,
                headers={"Retry-After": str(KEYS_RETRY_AFTER_SECONDS)},
            )
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

    def check(request: Request, _bearer: Bearer = None) -> RequestContext:
        context = authenticated(request)
        if not any(context.has_role(r) for r in accepted):
            raise HTTPException(status_code=status.HTTP_403_FORBIDDEN, detail=f"{needed} required")
        return context

    return check


def units_of_work(request: Request) -> UnitOfWorkFactory:
    """FastAPI dependency: the factory the composition root put on the app, the one of the
    source of the context whose route was matched."""
    by_endpoint = getattr(request.app.state, "units_by_endpoint", {})
    factory = by_endpoint.get(request.scope.get("endpoint")) or getattr(
        request.app.state, "units_of_work", None
    )
    if not callable(factory):
        msg = "app.state.units_of_work is not set; build the app with outbox_kit.runtime.app.create_app"
        raise TypeError(msg)
    return cast("UnitOfWorkFactory", factory)


IDEMPOTENCY_KEY_HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotent-Replayed"
# Visible ASCII, as clients send UUIDs and similar tokens: no space, no control character.
KEY_PATTERN = r"^[\x21-\x7e]+$"
KEY_MAX_LENGTH = 255  # the column's size


def idempotency_key(
    request: Request,
    key: Annotated[
        str | None,
        Header(
            alias=IDEMPOTENCY_KEY_HEADER,
            min_length=1,
            max_length=KEY_MAX_LENGTH,
            pattern=KEY_PATTERN,
            description=(
                "Makes a retry safe: the same key and body (per tenant) answer the first answer"
                " without running the command again; the same key with another body answers 422."
                " Kept API__IDEMPOTENCY_KEY_RETENTION_HOURS (24 h by default)."
            ),
        ),
    ] = None,
) -> IdempotencyKey | None:
    """FastAPI dependency: the caller's key for this operation (method and path), if any."""
    if key is None:
        return None
    return IdempotencyKey(key, f"{request.method} {request.url.path}")


def idempotent_response(answer: Answer) -> Response:
    """The answer as sent the first time (same status, same bytes)."""
    headers = {REPLAYED_HEADER: "true"} if answer.replayed else None
    return Response(
        answer.body, status_code=answer.status_code, media_type="application/json", headers=headers
    )
