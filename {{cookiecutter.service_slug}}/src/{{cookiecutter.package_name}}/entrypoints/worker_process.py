"""The worker command: processors and consumers until SIGTERM, then a graceful stop (processors
first, then consumers and the connection) within a hard deadline (``stopping``).

With a port (``--port`` or ``WORKER__PORT``) the worker also serves ``/livez``, ``/readyz`` and
``/metrics`` there, so it can be probed and scraped; without one it listens on nothing, so any
number of workers can share a host. The first line it logs says which.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket

from ..container import Container
from .serving import bound_port, serve_app, socket_host
from .stopping import stop_within_deadline

log = logging.getLogger(__name__)


async def run_worker(container: Container) -> None:
    """The worker alone, with no HTTP endpoint."""
    from ..container import startup_diagnostics  # noqa: PLC0415

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
    await stop.wait()
    await stop_within_deadline(container, worker, force_exit=True)


async def serve_worker(container: Container, listening: socket.socket) -> None:
    """The worker with its probes on ``listening``; the app's lifespan starts and stops it."""
    from .app import create_worker_app  # noqa: PLC0415

    base = f"http://{socket_host(listening)}:{bound_port(listening)}"
    log.info("worker: /livez, /readyz and /metrics on %s", base)
    await serve_app(create_worker_app(container), listening, container.settings())
