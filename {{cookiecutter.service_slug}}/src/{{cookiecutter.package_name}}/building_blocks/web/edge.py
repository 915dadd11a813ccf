"""The HTTP edge: what is refused before any route parses a request.

* A body over ``API__MAX_BODY_BYTES`` is 413: at once when ``Content-Length`` says so, otherwise
  as soon as the bytes received pass the limit (a chunked body is counted as it streams, never
  read to its end).
* Text that no database stores alike (see :mod:`.text`) in the path, the query, or a JSON or
  form body is 422 for every route, including the ones a context adds later, so SQLite and
  PostgreSQL give one answer. Other content types (uploads) pass on as bytes.

The common case stays cheap: the body is read once (bounded by the limit) and handed on
unchanged; a JSON body is decoded once and parsed a second time only when it holds a ``\\u0000``
or ``\\uD800``-``\\uDFFF`` escape, the only way JSON text can carry those characters (a surrogate
*pair* is one ordinary character and passes).
"""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import parse_qsl

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..kernel.text import is_storable, shorten

UNSTORABLE_MESSAGE = "NUL characters, unpaired surrogates and invalid UTF-8 are not accepted in text"
_RISKY_ESCAPE = re.compile(r"\\u(?:0000|[dD][89a-fA-F][0-9a-fA-F]{2})")
Location = list[str | int]


class _Refused(Exception):  # noqa: N818 (a control-flow signal carrying the answer)
    def __init__(self, response: JSONResponse) -> None:
        super().__init__(response.status_code)
        self.response = response


class _ClientLeft(Exception):  # noqa: N818 (a control-flow signal)
    """The client disconnected while sending the body: nobody is left to answer."""


def too_large(limit: int) -> _Refused:
    detail = f"the request body is larger than {limit} bytes"
    return _Refused(JSONResponse({"detail": detail}, status_code=413))


def unstorable(location: Location) -> _Refused:
    error = {"type": "unstorable_text", "loc": location, "msg": UNSTORABLE_MESSAGE}
    return _Refused(JSONResponse({"detail": [error]}, status_code=422))


class RequestEdgeMiddleware:
    """Pure ASGI middleware: size limit and unstorable-text check for every HTTP request."""

    def __init__(self, app: ASGIApp, *, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

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
        except _Refused as refusal:
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
    if _RISKY_ESCAPE.search(text) is None:
        return
    try:
        document = json.loads(text)
    except (ValueError, RecursionError):
        return  # malformed JSON: the route's own parser answers it
    location = _first_unstorable(document)
    if location is not None:
        raise unstorable(["body", *location])


def _first_unstorable(document: Any) -> Location | None:  # noqa: ANN401 (any JSON value)
    """Where the first unstorable string (value or key) sits; iterative, so depth costs no stack."""
    stack: list[tuple[Location, Any]] = [([], document)]
    while stack:
        location, value = stack.pop()
        if isinstance(value, str):
            if not is_storable(value):
                return location
        elif isinstance(value, dict):
            for key, item in value.items():
                if not is_storable(key):
                    return [*location, shorten(key)]
                stack.append(([*location, key], item))
        elif isinstance(value, list):
            stack.extend(([*location, index], item) for index, item in enumerate(value))
    return None
