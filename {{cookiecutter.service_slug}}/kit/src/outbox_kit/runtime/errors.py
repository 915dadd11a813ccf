"""Errors as answers: domain errors become JSON problems with stable codes (404, 409, 422), never
tracebacks; a database that did not answer in time is 503 naming the context and its source; a
validation error echoes at most a short prefix of what it refused.

``ErrorOut`` is the body of every error answer and ``error_responses`` documents them in the
OpenAPI document, so a client generated from it knows every status an operation can return.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request, status
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from outbox_kit.application.text import short_echo
from outbox_kit.domain import ConcurrencyError, DomainError, NotFoundError
from outbox_kit.persistence.database import is_database_outage, is_database_timeout, is_transient
from outbox_kit.persistence.idempotency import IdempotencyKeyReusedError

log = logging.getLogger(__name__)

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
