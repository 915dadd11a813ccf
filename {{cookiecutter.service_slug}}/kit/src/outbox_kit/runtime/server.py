"""Serving a service's processes: ``run`` (API and worker in one process), ``api``, and the
worker (``run_worker``; with its probes, ``serve_worker``), each on a socket bound before anything
starts, with uvicorn's configuration and its time limits for slow clients; and the development
banner (what to try first, credentials masked).

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
import logging
import signal
import socket
import sys
from typing import TYPE_CHECKING, cast

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from outbox_kit.application.text import mask_credentials
from outbox_kit.runtime.app import (
    OWN_PROCESS_STATE,
    create_app,
    create_worker_app,
    stop_within_deadline,
)
from outbox_kit.runtime.diagnostics import startup_diagnostics
from outbox_kit.runtime.heap import freeze_start_up_heap

if TYPE_CHECKING:
    from fastapi import FastAPI

    from outbox_kit.runtime.container import OutboxContainer
    from outbox_kit.runtime.settings import ApiSettings, ServiceSettings

log = logging.getLogger(__name__)


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


async def serve(container: OutboxContainer, listening: socket.socket, *, with_worker: bool) -> None:
    """``run`` and ``api``: the API (and, for ``run``, the worker) on ``listening``."""
    settings = container.settings()
    app = create_app(container, with_worker=with_worker)
    if settings.environment.value == "development":
        base = f"http://{socket_host(listening)}:{bound_port(listening)}"
        print_banner(container, base, with_worker=with_worker)
    await serve_app(app, listening, settings)


async def run_worker(container: OutboxContainer) -> None:
    """The worker alone, with no HTTP endpoint, until SIGTERM or SIGINT; then a graceful stop
    (processors first, then consumers and the connection) within a hard deadline."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # first: a stop asked for while starting is kept
        loop.add_signal_handler(sig, stop.set)
    log.info(
        "worker: no HTTP endpoint (give it a port with --port or WORKER__PORT to serve "
        "/livez, /readyz and /metrics)"
    )
    startup_diagnostics(container)
    bus = container.bus()
    await bus.start()
    worker = container.worker()
    await worker.start()
    freeze_start_up_heap()
    await stop.wait()
    await stop_within_deadline(container, worker, force_exit=True)


async def serve_worker(container: OutboxContainer, listening: socket.socket) -> None:
    """The worker with its probes on ``listening``; the app's lifespan starts and stops it."""
    base = f"http://{socket_host(listening)}:{bound_port(listening)}"
    log.info("worker: /livez, /readyz and /metrics on %s", base)
    await serve_app(create_worker_app(container), listening, container.settings())


async def serve_app(app: FastAPI, listening: socket.socket, settings: ServiceSettings) -> None:
    """Serve ``app`` with uvicorn on an already bound socket until SIGTERM or SIGINT, with the
    time limits for slow clients (``API__HEADER_READ_TIMEOUT_SECONDS`` and the keep-alive).

    After the signal, requests still running after ``API__SHUTDOWN_TIMEOUT_SECONDS`` are
    cancelled (their transactions roll back), so one stuck on a lock or a silent dependency
    cannot hold the process; then the lifespan stops the rest within its own deadline."""
    server = uvicorn.Server(server_config(app, settings.api, settings.logging.level))
    setattr(app.state, OWN_PROCESS_STATE, True)  # a process of its own: see ``app``
    # uvicorn shuts down gracefully on SIGTERM/SIGINT, then re-raises the signal to whatever
    # handler was installed before it: make that a no-op, so a graceful stop exits with 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _already_stopped)
    await server.serve(sockets=[listening])


def _already_stopped(_signal: int, _frame: object) -> None:
    """The server has already shut down gracefully when uvicorn re-raises the signal."""


def bound_port(listening: socket.socket) -> int:
    return int(listening.getsockname()[1])


def socket_host(listening: socket.socket) -> str:
    host = str(listening.getsockname()[0])
    return f"[{host}]" if ":" in host else host


def print_banner(container: OutboxContainer, base: str, *, with_worker: bool) -> None:
    """What is running and what to try first (development mode only): every context's
    ``examples``, or the service's own surface when no context has any."""
    settings = container.settings()
    package = type(settings).__module__.partition(".")[0]
    token = f"TOKEN=$({sys.executable} -m {package} token --tenant acme --user alice --roles outbox-admin)"
    auth = '-H "Authorization: Bearer $TOKEN"'
    tries = [
        e.replace("{base}", base).replace("{auth}", auth) for m in container.modules() for e in m.examples
    ]
    if not tries:
        tries = [f"curl -s {base}/readyz", f"curl -s {base}/admin/outbox/pending {auth}"]
    lines = [
        (
            f"{type(settings).service_name} on {base} ({'API + worker' if with_worker else 'API only'}; "
            f"{mask_credentials(settings.database.url)}; transport {settings.message_bus.transport.value}; "
            f"outbox {'on' if settings.message_bus.outbox_enabled else 'off'})."
        ),
        f"  Try:  {token}",
        *(f"        {line}" for line in tries),
        f"  Docs: {base}/docs   Metrics: {base}/metrics   AsyncAPI: {base}/asyncapi",
    ]
    print("\n".join(lines), file=sys.stderr, flush=True)
