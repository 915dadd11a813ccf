"""The HTTP server's configuration (from :class:`~outbox_kit.runtime.settings.ApiSettings`), with
time limits for slow clients.

uvicorn bounds the idle time between two requests of a connection (``timeout_keep_alive``) and
the size of a request head (h11's 16 KiB), but not the time a head takes to arrive: a client that
opens a connection and sends nothing, or a header a byte at a time, held the connection for ever
(a few hundred of them take every file descriptor). :class:`HeadDeadlineProtocol` closes a
connection whose request head is not complete within ``API__HEADER_READ_TIMEOUT_SECONDS`` of its
first byte (or of the connection opening): with a 408 when a head was begun, silently when nothing
came. The body's time limit is the edge middleware's (``API__BODY_READ_TIMEOUT_SECONDS``, a 408),
since a body is read by the application, not the server.

The protocol is uvicorn's h11 implementation (always installed with uvicorn) plus a timer; it
relies only on what uvicorn's HTTP protocols have in common: ``connection_made``,
``data_received``, ``connection_lost``, ``transport`` and ``cycle`` (the current request, set
once its head is parsed).
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, cast

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

if TYPE_CHECKING:
    from fastapi import FastAPI

    from outbox_kit.runtime.settings import ApiSettings


def _timeout_answer(seconds: float) -> bytes:
    body = json.dumps(
        {"detail": f"the request head did not arrive within {seconds:g} s (API__HEADER_READ_TIMEOUT_SECONDS)"}
    ).encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class HeadDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request head is late."""

    head_timeout_seconds: float = 10.0
    _head_timer: asyncio.TimerHandle | None = None
    _head_begun = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(begun=False)  # a connection that never sends anything is closed too

    def data_received(self, data: bytes) -> None:
        if self._between_requests():
            if self._head_timer is None:
                self._arm(begun=True)  # the first byte of the next request on a kept-alive connection
            self._head_begun = True
        request = self.cycle
        super().data_received(data)
        if self.cycle is not request:  # a head was parsed: the request is the application's now
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self, *, begun: bool) -> None:
        self._disarm()
        self._head_begun = begun
        self._head_timer = asyncio.get_running_loop().call_later(self.head_timeout_seconds, self._head_late)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._between_requests():
            return
        if self._head_begun:
            self.transport.write(_timeout_answer(self.head_timeout_seconds))
        self.transport.close()


def protocol_with_head_deadline(seconds: float) -> type[HeadDeadlineProtocol]:
    """The protocol class uvicorn instantiates per connection, with this head time limit."""

    class Protocol(HeadDeadlineProtocol):
        head_timeout_seconds = seconds

    return Protocol


def server_config(app: FastAPI, api: ApiSettings, log_level: str) -> uvicorn.Config:
    """uvicorn's configuration for ``run``, ``api`` and the worker's probes."""
    return uvicorn.Config(
        app,
        log_config=None,
        lifespan="on",
        log_level=log_level.lower(),
        http=protocol_with_head_deadline(api.header_read_timeout_seconds),
        timeout_keep_alive=api.keep_alive_timeout_seconds,
        # Annotated int, but handed to asyncio.timeout, which takes any number of seconds.
        timeout_graceful_shutdown=cast("int", api.shutdown_timeout_seconds),
    )
