"""The HTTP edge: what is refused before any route parses a request.

* A body over ``API__MAX_BODY_BYTES`` is 413: at once when ``Content-Length`` says so, otherwise
  as soon as the bytes received pass the limit (a chunked body is counted as it streams, never
  read to its end).
* A body not fully received within ``API__BODY_READ_TIMEOUT_SECONDS`` is 408 and the connection
  is closed: a client sending a byte now and then would otherwise hold a request for ever. (The
  request head's own time limit is the server's: ``entrypoints/http_server.py``.)
* Text that no database stores alike (see :mod:`.text`) in the path, the query, or a JSON or
  form body is 422 for every route, including the ones a context adds later, so SQLite and
  PostgreSQL give one answer. Other content types (uploads) pass on as bytes.

The common case stays cheap: the body is read once (bounded by the limit) and handed on
unchanged; a JSON body is decoded once and parsed a second time only when it holds a ``\\u0000``
or ``\\uD800``-``\\uDFFF`` escape, the only way JSON text can carry those characters (a surrogate
*pair* is one ordinary character and passes).
"""

from __future__ import annotations

import asyncio

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .storable_text import Refused, _refuse_unstorable_body, _refuse_unstorable_url


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
