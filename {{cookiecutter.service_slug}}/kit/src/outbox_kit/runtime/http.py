"""The HTTP edge: bearer tokens, request limits, refused text, the request context, tracing,
and the FastAPI dependencies routes use.

Bearer tokens: HS256 JWTs carrying ``sub`` (user), ``tenant`` and ``roles``.

Minting exists for development and tests (``python -m <package> token``); production services
usually receive tokens from an identity provider that shares the secret or key.

The HTTP edge: request limits, the request context, tracing, and the FastAPI dependencies.

Refusing, before any route reads it, text no database stores alike: NUL, unpaired surrogates and
invalid UTF-8, wherever they are (path, query, a JSON or form body, keys included); and, in a JSON
body, numbers JSON has no finite value for: ``NaN``, ``Infinity``, ``-Infinity`` and literals
beyond the float range (``1e400``). Python's parser reads them (as nan and inf), so a model
would hold a value no JSON encoder writes back, and the 422 that echoed it failed with a 500.

The HTTP edge: what is refused before any route parses a request.

* A body over ``API__MAX_BODY_BYTES`` is 413: at once when ``Content-Length`` says so, otherwise
  as soon as the bytes received pass the limit (a chunked body is counted as it streams, never
  read to its end).
* A body not fully received within ``API__BODY_READ_TIMEOUT_SECONDS`` is 408 and the connection
  is closed: a client sending a byte now and then would otherwise hold a request for ever. (The
  request head's own time limit is the server's: ``runtime/server.py``.)
* Text that no database stores alike (see :mod:`.text`) in the path, the query, or a JSON or
  form body is 422 for every route, including the ones a context adds later, so SQLite and
  PostgreSQL give one answer. Other content types (uploads) pass on as bytes.

The common case stays cheap: the body is read once (bounded by the limit) and handed on
unchanged; a JSON body is decoded once and parsed a second time only when it holds a ``\\u0000``
or ``\\uD800``-``\\uDFFF`` escape, the only way JSON text can carry those characters (a surrogate
*pair* is one ordinary character and passes).

HTTP server spans from the maintained OpenTelemetry FastAPI instrumentation (tracing on only).

It names each span after the route template (``GET /orders/{order_id}``), records the HTTP
semantic-convention attributes and continues the caller's ``traceparent``; the service's
request context then reads that span's ``traceparent`` for the outbox rows the request writes.
The probes and ``/metrics`` get no span: an orchestrator polling them would bury the requests.
The per-message ``receive``/``send`` sub-spans are left out for the same reason.

HTTP glue shared by every bounded context: the request context and error mapping.

:class:`RequestContextMiddleware` reads ``X-Correlation-Id`` (validated, generated when absent,
echoed on every response) and the bearer token, and sets the ambient request context for the
request. A bad token does not fail the request by itself; endpoints that need an identity depend
on :func:`authenticated`, which answers 401 with the reason.

The outbox rows a request writes carry a ``traceparent``: with tracing on, that of the server span
the OpenTelemetry FastAPI instrumentation opened around the request (see ``trace_requests``);
with tracing off, the caller's own, so a trace that started upstream runs on through this
service, or a fresh one, so every row can still be followed in the logs.

FastAPI dependencies a context's routes use: the caller (401 without a valid token, 403 without
a role) and the unit-of-work factory.

The ``Idempotency-Key`` header of a create command, and its answer (see ``idempotency/keys``).

A route takes ``key: Annotated[IdempotencyKey | None, Depends(idempotency_key)]``, runs its
command through ``run_once(units, operation, key=key, request=..., status_code=201)`` and returns
``idempotent_response(answer)``: the first answer's status and exact bytes, with
``Idempotent-Replayed: true`` when it is a repeat."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Annotated, Any, cast
from urllib.parse import parse_qsl

import jwt
from fastapi import Depends, FastAPI, Header, HTTPException, Request, Response, status
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from jwt import PyJWK
from pydantic import BaseModel
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from outbox_kit.application.clock import Clock
from outbox_kit.application.context import (
    MAX_ROLES_BYTES,
    MAX_TENANT_BYTES,
    MAX_USER_BYTES,
    InvalidContextError,
    RequestContext,
    check_roles,
    current_context,
    fits,
    flattened_size,
    new_correlation_id,
    new_traceparent,
    use_context,
    utf8_size,
    validate_correlation_id,
    validate_traceparent,
)
from outbox_kit.application.error_tracking import tag_error_reports
from outbox_kit.application.text import ECHO_LIMIT, is_plain_identifier, is_storable, shorten
from outbox_kit.application.tracing import NoTracing, Tracing
from outbox_kit.application.unit_of_work import UnitOfWorkFactory
from outbox_kit.domain import ConcurrencyError, DomainError, NotFoundError
from outbox_kit.persistence.database import is_database_outage, is_database_timeout, is_transient
from outbox_kit.persistence.idempotency import Answer, IdempotencyKey, IdempotencyKeyReusedError
from outbox_kit.runtime.identity_provider import InvalidTokenError, KeysUnavailableError, ProviderKeys

log = logging.getLogger(__name__)

# Far above any token this service mints (three short claims); a longer one is refused before
# it is decoded, so an oversized header costs no base64 and JSON work.
MAX_TOKEN_LENGTH = 8192
# The registered times, in seconds since the epoch. PyJWT reads them with int(), so a string, a
# float and 1e308 (a token that never expires) passed; a time is an integer up to 9999-12-31.
TIME_CLAIMS = ("exp", "nbf", "iat")
LATEST_TIME = 253_402_300_799


class SharedSecretTokens(StrEnum):
    """Where tokens signed with ``AUTH__JWT_SECRET`` are accepted: from anyone without a provider;
    with one, from loopback callers in development (the ``token`` command keeps working on a
    laptop) and never in production."""

    ANYWHERE = "anywhere"
    LOOPBACK = "loopback"
    NEVER = "never"


@dataclass(frozen=True, slots=True)
class ClaimNames:
    """Where a token carries the user, the tenant and the roles. A name is looked up as written
    first, then as a dotted path (``realm_access.roles``), so a namespaced claim such as
    ``https://example.com/roles`` works as well."""

    user: str = "sub"
    tenant: str = "tenant"
    roles: str = "roles"


STANDARD_CLAIMS = ClaimNames()


@dataclass(frozen=True, slots=True)
class Identity:
    """What a verified token says about the caller."""

    user_id: str
    tenant_id: str
    roles: tuple[str, ...]


class TokenService:
    """Mint and verify bearer tokens.

    Shared-secret tokens (HS256 by default) are minted here for development and tests and
    verified with ``secret``; with a ``provider``, the provider's tokens are verified with the keys
    it publishes, for ``provider_algorithms`` only, against ``issuer`` and ``audience`` (both
    required then), and shared-secret tokens are accepted as ``shared_secret_tokens`` says."""

    def __init__(
        self,
        *,
        secret: str,
        algorithm: str = "HS256",
        issuer: str = "",
        audience: str = "",
        ttl: timedelta = timedelta(hours=1),
        clock: Clock,
        claims: ClaimNames = STANDARD_CLAIMS,
        provider: ProviderKeys | None = None,
        provider_algorithms: tuple[str, ...] = ("RS256",),
        shared_secret_tokens: SharedSecretTokens = SharedSecretTokens.ANYWHERE,
    ) -> None:
        if provider is not None and not (issuer and audience):
            msg = "tokens of an identity provider are checked against an issuer and an audience: set both"
            raise ValueError(msg)
        self._secret = secret
        self._algorithm = algorithm
        self._issuer = issuer
        self._audience = audience
        self._ttl = ttl
        self._clock = clock
        self._claims = claims
        self._provider = provider
        self._provider_algorithms = provider_algorithms
        self._shared = SharedSecretTokens.ANYWHERE if provider is None else shared_secret_tokens

    def mint(self, *, user_id: str, tenant_id: str, roles: tuple[str, ...] = ()) -> str:
        """A shared-secret token carrying the identity under the configured claim names."""
        now: datetime = self._clock()
        claims: dict[str, Any] = {"iat": now, "exp": now + self._ttl}
        _put_claim(claims, self._claims.user, user_id)
        _put_claim(claims, self._claims.tenant, tenant_id)
        _put_claim(claims, self._claims.roles, list(roles))
        if self._issuer:
            claims["iss"] = self._issuer
        if self._audience:
            claims["aud"] = self._audience
        return jwt.encode(claims, self._secret, algorithm=self._algorithm)

    def verify(self, token: str) -> Identity:
        """A shared-secret token's identity (wherever it comes from: the ``token`` command's check)."""
        _refuse_oversized(token)
        try:
            claims = jwt.decode(
                token,
                self._secret,
                algorithms=[self._algorithm],
                issuer=self._issuer or None,
                audience=self._audience or None,
                options={"require": ["exp"]},
            )
        except jwt.PyJWTError as error:
            msg = f"invalid bearer token: {error}"
            raise InvalidTokenError(msg) from error
        return self._identity(claims)

    async def authenticate(self, token: str, *, client_host: str | None) -> Identity:
        """The identity of a request's bearer token, ``client_host`` being who sent it."""
        if self._provider is None:
            return self.verify(token)
        _refuse_oversized(token)
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError as error:
            msg = f"invalid bearer token: {error}"
            raise InvalidTokenError(msg) from error
        algorithm, kid = header.get("alg"), header.get("kid")
        if algorithm == self._algorithm:
            if self._shared is SharedSecretTokens.LOOPBACK and client_host and is_loopback(client_host):
                return self.verify(token)
            msg = (
                f"invalid bearer token: {self._algorithm} tokens signed with AUTH__JWT_SECRET are "
                "accepted only from loopback in development; send the identity provider's token"
            )
            raise InvalidTokenError(msg)
        if algorithm not in self._provider_algorithms:
            shown = short_echo(algorithm)
            msg = f"invalid bearer token: algorithm {shown!r} is not accepted (AUTH__JWT_ALGORITHMS)"
            raise InvalidTokenError(msg)
        if not isinstance(kid, str | None):
            msg = "invalid bearer token: its 'kid' header must be a string"
            raise InvalidTokenError(msg)
        key = await self._provider.key_for(kid)
        return self._identity(self._provider_claims(token, key))

    def _provider_claims(self, token: str, key: PyJWK) -> dict[str, Any]:
        try:
            return jwt.decode(
                token,
                key,
                # The key's own algorithm only: a token cannot choose how the key is used.
                algorithms=[key.algorithm_name],
                issuer=self._issuer,
                audience=self._audience,
                options={"require": ["exp", "iss", "aud"]},
            )
        except jwt.PyJWTError as error:
            msg = f"invalid bearer token: {error}"
            raise InvalidTokenError(msg) from error

    def _identity(self, claims: dict[str, Any]) -> Identity:
        _refuse_odd_times(claims)
        names = self._claims
        # Bytes in UTF-8, the unit consumers bound the signed headers in: a value that fit in
        # characters but not in bytes was accepted here and refused by every consumer.
        user = _bounded_text(names.user, _claim_at(claims, names.user), MAX_USER_BYTES)
        tenant = _bounded_text(names.tenant, _claim_at(claims, names.tenant), MAX_TENANT_BYTES)
        roles = self._roles(claims)
        _refuse_control_characters(**{names.user: [user], names.tenant: [tenant], names.roles: roles})
        try:
            checked = check_roles(roles)  # the one check every way into a context makes
        except InvalidContextError as error:
            msg = f"invalid bearer token: {names.roles!r}: {error}"
            raise InvalidTokenError(msg) from None
        if flattened_size(checked) > MAX_ROLES_BYTES:
            msg = (
                f"invalid bearer token: {names.roles!r} must be at most {MAX_ROLES_BYTES} bytes in "
                f"UTF-8 comma-joined, got {flattened_size(checked)}"
            )
            raise InvalidTokenError(msg)
        return Identity(user_id=user, tenant_id=tenant, roles=checked)

    def _roles(self, claims: dict[str, Any]) -> list[str]:
        """The roles claim as a list: a list of strings, or one string of roles separated by
        commas or spaces (an OAuth scope); absent, none."""
        name = self._claims.roles
        roles = _claim_at(claims, name)
        if roles is None:
            return []
        if isinstance(roles, str):
            return [r for r in re.split(r"[, ]", roles) if r]
        if not isinstance(roles, list) or not all(isinstance(r, str) for r in roles):
            msg = f"invalid bearer token: {name!r} must be a list of strings"
            raise InvalidTokenError(msg)
        return roles


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name or "": it may resolve to (or mean) any interface
        return False


def _refuse_oversized(token: str) -> None:
    if len(token) > MAX_TOKEN_LENGTH:
        msg = f"invalid bearer token: longer than {MAX_TOKEN_LENGTH} characters"
        raise InvalidTokenError(msg)


def _claim_at(claims: dict[str, Any], name: str) -> object:
    if name in claims:
        return claims[name]
    value: object = claims
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _put_claim(claims: dict[str, Any], name: str, value: object) -> None:
    *path, last = name.split(".")
    for part in path:
        claims = claims.setdefault(part, {})
    claims[last] = value


def _bounded_text(claim: str, value: object, limit: int) -> str:
    if isinstance(value, str) and fits(value, limit):
        return value
    got = f", got {utf8_size(value)}" if isinstance(value, str) else ""
    msg = f"invalid bearer token: '{claim}' must be a string of 1-{limit} bytes in UTF-8{got}"
    raise InvalidTokenError(msg)


def _refuse_odd_times(claims: dict[str, Any]) -> None:
    for claim in TIME_CLAIMS:
        value = claims.get(claim)
        if value is None:
            continue
        if type(value) is not int or not 0 <= value <= LATEST_TIME:
            msg = f"invalid bearer token: '{claim}' must be an integer number of seconds up to {LATEST_TIME}"
            raise InvalidTokenError(msg)


def _refuse_control_characters(**claims: list[str]) -> None:
    """The identity is copied into every row, header and log line the request causes: a CRLF
    or NUL there would forge lines or break storage, so the whole token is refused."""
    for claim, values in claims.items():
        if not all(is_plain_identifier(value) for value in values):
            msg = f"invalid bearer token: '{claim}' must not contain control characters"
            raise InvalidTokenError(msg)


UNSTORABLE_MESSAGE = "NUL characters, unpaired surrogates and invalid UTF-8 are not accepted in text"
NON_FINITE_MESSAGE = (
    "non-finite numbers (NaN, Infinity, or beyond the float range such as 1e400) are not accepted"
)

_RISKY_ESCAPE = re.compile(r"\\u(?:0000|[dD][89a-fA-F][0-9a-fA-F]{2})")
# What a non-finite number needs: the words, an exponent of 3+ digits, or 200+ digits in a row
# (a 2-digit exponent reaches 1e308 only with 210+ integer digits). Only a body with one of these
# is parsed here a second time; a match inside a string is a false alarm the parse clears. The
# digit run matches only at its start: tried at every digit, a long run cost quadratic time.
_RISKY_NUMBER = re.compile(r"NaN|Infinity|[eE]\+?[0-9]{3}|(?<![0-9])[0-9]{200}")

Location = list[str | int]


class Refused(Exception):  # noqa: N818 (a control-flow signal carrying the answer)
    def __init__(self, response: JSONResponse) -> None:
        super().__init__(response.status_code)
        self.response = response


def unstorable(location: Location) -> Refused:
    error = {"type": "unstorable_text", "loc": location, "msg": UNSTORABLE_MESSAGE}
    return Refused(JSONResponse({"detail": [error]}, status_code=422))


def non_finite(location: Location) -> Refused:
    error = {"type": "non_finite_number", "loc": location, "msg": NON_FINITE_MESSAGE}
    return Refused(JSONResponse({"detail": [error]}, status_code=422))


class _NonFinite:
    """Stands, in the parsed document, for a number that has no finite value."""


_NON_FINITE = _NonFinite()


def _finite_or_marker(literal: str) -> float | _NonFinite:
    number = float(literal)
    return number if math.isfinite(number) else _NON_FINITE


def _refuse_unstorable_url(scope: Scope) -> None:
    if not is_storable(str(scope.get("path", ""))):
        raise unstorable(["path"])
    query: bytes = scope.get("query_string", b"")
    if b"%" in query:  # a NUL can only arrive percent-encoded
        _refuse_unstorable_pairs("query", query)


def _refuse_unstorable_pairs(where: str, encoded: bytes) -> None:
    for name, value in parse_qsl(encoded.decode("latin-1"), keep_blank_values=True):
        if not (is_storable(name) and is_storable(value)):
            raise unstorable([where, shorten(name)])


def _refuse_unstorable_body(content_type: str, body: bytes) -> None:
    media_type = content_type.partition(";")[0].strip().lower()
    if media_type == "application/json" or media_type.endswith("+json"):
        _refuse_unstorable_json(body)
    elif media_type == "application/x-www-form-urlencoded":
        _refuse_unstorable_pairs("body", body)


def _refuse_unstorable_json(body: bytes) -> None:
    try:
        # Strict UTF-8: JSON parsers decode with 'surrogatepass' and would let encoded surrogates in.
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise unstorable(["body"]) from None
    if not is_storable(text):
        raise unstorable(["body"])
    if _RISKY_ESCAPE.search(text) is None and _RISKY_NUMBER.search(text) is None:
        return
    try:
        document = json.loads(text, parse_constant=lambda _: _NON_FINITE, parse_float=_finite_or_marker)
    except (ValueError, RecursionError):
        return  # malformed JSON: the route's own parser answers it
    found = _first_refused(document)
    if found is not None:
        location, refusal = found
        raise refusal(["body", *location])


def _first_refused(document: Any) -> tuple[Location, Callable[[Location], Refused]] | None:  # noqa: ANN401
    """Where the first unstorable string (value or key) or non-finite number sits, and the
    refusal for it; iterative, so depth costs no stack."""
    stack: list[tuple[Location, Any]] = [([], document)]
    while stack:
        location, value = stack.pop()
        if isinstance(value, str):
            if not is_storable(value):
                return location, unstorable
        elif value is _NON_FINITE:
            return location, non_finite
        elif isinstance(value, dict):
            for key, item in value.items():
                if not is_storable(key):
                    return [*location, shorten(key)], unstorable
                stack.append(([*location, key], item))
        elif isinstance(value, list):
            stack.extend(([*location, index], item) for index, item in enumerate(value))
    return None


class _ClientLeft(Exception):  # noqa: N818 (a control-flow signal)
    """The client disconnected while sending the body: nobody is left to answer."""


def too_large(limit: int) -> Refused:
    detail = f"the request body is larger than {limit} bytes"
    return Refused(JSONResponse({"detail": detail}, status_code=413))


def too_slow(seconds: float) -> Refused:
    detail = f"the request body did not arrive within {seconds:g} s (API__BODY_READ_TIMEOUT_SECONDS)"
    # The rest of the body may still be on its way: the connection is not reused.
    return Refused(JSONResponse({"detail": detail}, status_code=408, headers={"connection": "close"}))


class RequestEdgeMiddleware:
    """Pure ASGI middleware: size and time limits and the unstorable-text check for every HTTP
    request."""

    def __init__(self, app: ASGIApp, *, max_body_bytes: int, body_read_timeout_seconds: float) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_read_timeout_seconds = body_read_timeout_seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        try:
            self._refuse_a_declared_excess(headers)
            _refuse_unstorable_url(scope)
            body = await self._read_body(receive)
            _refuse_unstorable_body(headers.get("content-type", ""), body)
        except Refused as refusal:
            await refusal.response(scope, receive, send)
            return
        except _ClientLeft:
            return
        await self.app(scope, _replaying(body, receive), send)

    def _refuse_a_declared_excess(self, headers: Headers) -> None:
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise too_large(self.max_body_bytes)

    async def _read_body(self, receive: Receive) -> bytes:
        try:
            async with asyncio.timeout(self.body_read_timeout_seconds):
                return await self._read_body_untimed(receive)
        except TimeoutError:
            raise too_slow(self.body_read_timeout_seconds) from None

    async def _read_body_untimed(self, receive: Receive) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientLeft
            chunk: bytes = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise too_large(self.max_body_bytes)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replaying(body: bytes, receive: Receive) -> Receive:
    """The body read here once, then the server's own messages (a disconnect, say)."""
    pending = True

    async def replay() -> Message:
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


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


# -- errors ------------------------------------------------------------------------------------------
# Errors as answers: domain errors become JSON problems with stable codes (404, 409, 422), never
# tracebacks; a validation error echoes at most a short prefix of what it refused.
#
# ``ErrorOut`` is the body of every error answer and ``error_responses`` documents them in the
# OpenAPI document, so a client generated from it knows every status an operation can return.


DATABASE_UNAVAILABLE = (
    "the database did not answer in time (a lock held elsewhere, or the database is overloaded or "
    "unreachable): nothing was changed, try again"
)


@dataclass(frozen=True)
class ContextOfRoute:
    """The bounded context a route belongs to and the source its database is: a route whose
    database cannot be reached answers 503 naming them, so a partial outage (one context's
    source down) reads as one, while the rest of the service answers."""

    context: str
    source: str

    @property
    def unavailable(self) -> str:
        return f"the {self.context} context's database (source {self.source!r}) is unavailable"


# A text field's pattern: no NUL (no database stores it alike; the edge refuses it, 422), so the
# OpenAPI document says what the service accepts.
STORABLE_TEXT = r"^[^\x00]*$"


class ErrorOut(BaseModel):
    """An error answer: ``detail`` says what was wrong (for a refused field, FastAPI's list of
    ``{loc, msg, type}``), ``code`` is a domain error's stable code."""

    detail: str | list[dict[str, Any]]
    code: str | None = None


WHY = {
    400: "A refused X-Correlation-Id or traceparent header, or a request the operator can fix",
    401: "No valid bearer token",
    403: "The token lacks the role this operation needs",
    404: "Not found (another tenant's row answers the same)",
    408: "The request head or body did not arrive in time (API__HEADER/BODY_READ_TIMEOUT_SECONDS)",
    409: "Conflict with the current state (a stale version, a transition not allowed)",
    413: "The body is larger than API__MAX_BODY_BYTES",
    422: (
        "A field the service refuses (FastAPI's field errors, text no database stores alike, "
        "or a non-finite number in a JSON body), or an Idempotency-Key already used for another "
        "request"
    ),
    503: (
        "The database did not answer in time or cannot be reached (code database_unavailable; a "
        "route of a context whose own source is down names it): nothing was changed, try again"
    ),
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for these error statuses, each with the :class:`ErrorOut` body."""
    return {status_code: {"model": ErrorOut, "description": WHY[status_code]} for status_code in statuses}


def install_error_handlers(app: FastAPI) -> None:
    """Domain errors become JSON problems with stable codes, never tracebacks."""

    async def domain_error(_request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, DomainError)  # noqa: S101 (registered for DomainError only)
        code = status.HTTP_409_CONFLICT
        if isinstance(error, NotFoundError):
            code = status.HTTP_404_NOT_FOUND
        elif isinstance(error, IdempotencyKeyReusedError) or (
            not isinstance(error, ConcurrencyError) and error.code == "invalid"
        ):
            code = status.HTTP_422_UNPROCESSABLE_CONTENT
        if error.field is not None:  # shaped like FastAPI's own validation errors
            detail = [{"loc": ["body", *error.field], "msg": error.message, "type": error.code}]
            return JSONResponse({"detail": detail, "code": error.code}, status_code=code)
        return JSONResponse({"detail": error.message, "code": error.code}, status_code=code)

    async def validation_error(_request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, RequestValidationError)  # noqa: S101 (registered for it only)
        detail = [_with_short_input(e) for e in jsonable_encoder(error.errors())]
        return JSONResponse({"detail": detail}, status_code=status.HTTP_422_UNPROCESSABLE_CONTENT)

    async def database_unavailable(request: Request, error: Exception) -> JSONResponse:
        """A statement past the statement timeout, no pooled connection in time, the database
        unreachable, or a conflict still there after ``uow.run``'s retries: the transaction was
        rolled back, so the caller may simply try again (not a 500 and a traceback)."""
        outage = is_database_outage(error)
        if not (outage or is_database_timeout(error) or is_transient(error)):
            raise error  # a real fault: the server's 500 and its traceback in the log
        log.warning("%s %s: database unavailable: %s", request.method, request.url.path, type(error).__name__)
        route = getattr(request.app.state, "context_by_endpoint", {}).get(request.scope.get("endpoint"))
        detail = route.unavailable if outage and route is not None else DATABASE_UNAVAILABLE
        return JSONResponse(
            {"detail": detail, "code": "database_unavailable"},
            status_code=status.HTTP_503_SERVICE_UNAVAILABLE,
            headers={"Retry-After": "1"},
        )

    app.add_exception_handler(DomainError, domain_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    # OSError: asyncpg's own timeout on a silent line, and a refused connect, come out bare.
    for database_error in (DBAPIError, PoolTimeoutError, OSError):
        app.add_exception_handler(database_error, database_unavailable)


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
