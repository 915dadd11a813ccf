"""The HTTP edge: what is refused before any route parses a request.

* A body over ``API__MAX_BODY_BYTES`` is 413: at once when ``Content-Length`` says so, otherwise
  as soon as the bytes received pass the limit (a chunked body is counted as it streams, never
  read to its end).
* A body not fully received within ``API__BODY_READ_TIMEOUT_SECONDS`` is 408 and the connection
  is closed: a client sending a byte now and then would otherwise hold a request for ever. (The
  request head's own time limit is the server's: ``runtime/server.py``.)
* Text that no database stores alike is 422 for every route, including the ones a context adds
  later, so SQLite and PostgreSQL give one answer: NUL, unpaired surrogates and invalid UTF-8,
  wherever they are (the path, the query, a JSON or form body, keys included); and, in a JSON
  body, numbers JSON has no finite value for: ``NaN``, ``Infinity``, ``-Infinity`` and literals
  beyond the float range (``1e400``). Python's parser reads them (as nan and inf), so a model
  would hold a value no JSON encoder writes back, and the 422 that echoed it failed with a 500.
  Other content types (uploads) pass on as bytes.

The common case stays cheap: the body is read once (bounded by the limit) and handed on
unchanged; a JSON body is decoded once and parsed a second time only when it holds a ``\\u0000``
or ``\\uD800``-``\\uDFFF`` escape, the only way JSON text can carry those characters (a surrogate
*pair* is one ordinary character and passes).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from outbox_kit.application.text import is_storable, shorten

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
