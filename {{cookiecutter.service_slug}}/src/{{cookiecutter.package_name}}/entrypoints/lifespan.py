"""What the HTTP app does when it starts and stops (``run`` also starts the worker in-process),
and the stop every process shares, bounded by a hard deadline."""

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

from fastapi import FastAPI

from ..building_blocks.kernel.tracing import Tracing
from ..building_blocks.runtime.worker import Worker
from ..container import Container, startup_diagnostics

log = logging.getLogger(__name__)


def lifespan(
    container: Container, *, with_worker: bool
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app's lifespan: start-up diagnostics, the bus connected (and, for ``run``, the worker
    started), and everything stopped in order on shutdown."""

    @asynccontextmanager
    async def run(_app: FastAPI) -> AsyncIterator[None]:
        startup_diagnostics(container)
        bus = container.bus()
        await bus.start()
        worker = container.worker() if with_worker else None
        if worker is not None:
            await worker.start()
        try:
            yield
        finally:
            await stop_within_deadline(container, worker)

    return run


def stop_deadline_seconds(container: Container, *, with_worker: bool) -> float:
    """How long stopping may take: the in-flight deliveries get ``OUTBOX__SHUTDOWN_TIMEOUT_SECONDS``
    (see ``Worker.stop``) and closing the broker connection and the database pool as long again;
    without a worker, closing alone."""
    timeout = container.settings().outbox.shutdown_timeout_seconds
    return 2 * timeout if with_worker else timeout


async def stop_within_deadline(container: Container, worker: Worker | None) -> None:
    """Stop the worker (which closes the bus) or the bus, then the database pool, then export the
    last spans, all within ``stop_deadline_seconds``. A dependency that does not answer (a
    database line gone silent, a broker that never acknowledges the close, a trace collector that
    never answers) is abandoned at the deadline: the process exits anyway, and the server drops
    the connection when it notices."""
    seconds = stop_deadline_seconds(container, with_worker=worker is not None)
    deadline = asyncio.get_running_loop().time() + seconds
    try:
        async with asyncio.timeout_at(deadline):
            if worker is not None:
                await worker.stop()  # processors first, then consumers and the bus
            else:
                await container.bus().stop()
            await container.database().dispose()
    except TimeoutError:
        log.error(  # noqa: TRY400 (the deadline, not a fault: no traceback to show)
            "shutdown: not finished within %g s (twice OUTBOX__SHUTDOWN_TIMEOUT_SECONDS with a "
            "worker, once without); the connections still open are abandoned",
            seconds,
        )
    await _shut_tracing_down(container.tracing(), deadline)


async def _shut_tracing_down(tracing: Tracing, deadline: float) -> None:
    """The last export blocks (up to the exporter's own timeout, ``OTEL_EXPORTER_OTLP_TIMEOUT``,
    when the collector does not answer), so it runs in a daemon thread, waited for until the
    deadline: one still hanging then does not hold the exit, and its spans are dropped."""
    loop = asyncio.get_running_loop()
    finished = loop.create_future()

    def done() -> None:
        if not finished.done():
            finished.set_result(None)

    def shut_down() -> None:
        try:
            tracing.shutdown()
        except Exception:
            log.warning("shutdown: the tracing exporter failed", exc_info=True)
        finally:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                loop.call_soon_threadsafe(done)

    threading.Thread(target=shut_down, name="tracing-shutdown", daemon=True).start()
    try:
        async with asyncio.timeout_at(deadline):
            await finished
    except TimeoutError:
        log.warning("shutdown: the last spans were not exported in time (no answer from the collector)")
