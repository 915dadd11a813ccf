"""The worker command: processors and consumers until SIGTERM, then a graceful stop (processors
first, then consumers and the connection)."""

from __future__ import annotations

import asyncio
import signal

from ..container import Container


async def run_worker(container: Container) -> None:
    from ..container import startup_diagnostics  # noqa: PLC0415

    startup_diagnostics(container)
    bus = container.bus()
    await bus.start()
    worker = container.worker()
    await worker.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await worker.stop()  # processors first, then consumers and the connection
    await container.database().dispose()
    container.tracing().shutdown()
