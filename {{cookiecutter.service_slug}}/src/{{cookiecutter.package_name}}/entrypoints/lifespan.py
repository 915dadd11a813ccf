"""What the HTTP app does when it starts and stops (``run`` also starts the worker in-process),
and the stop every process shares, bounded by a hard deadline."""

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

from fastapi import FastAPI

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
    """Stop the worker (which closes the bus) or the bus, then the database pool, all within
    ``stop_deadline_seconds``. A dependency that does not answer (a database line gone silent,
    a broker that never acknowledges the close) is abandoned at the deadline: the process exits
    anyway, and the server drops the connection when it notices."""
    deadline = stop_deadline_seconds(container, with_worker=worker is not None)
    try:
        async with asyncio.timeout(deadline):
            if worker is not None:
                await worker.stop()  # processors first, then consumers and the bus
            else:
                await container.bus().stop()
            await container.database().dispose()
    except TimeoutError:
        log.error(  # noqa: TRY400 (the deadline, not a fault: no traceback to show)
            "shutdown: not finished within %g s (twice OUTBOX__SHUTDOWN_TIMEOUT_SECONDS with a "
            "worker, once without); the connections still open are abandoned",
            deadline,
        )
    container.tracing().shutdown()
