"""What the HTTP app does when it starts and stops (``run`` also starts the worker in-process)."""

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

from fastapi import FastAPI

from ..container import Container, startup_diagnostics


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
            if worker is not None:
                await worker.stop()  # stops the bus too
            else:
                await bus.stop()
            await container.database().dispose()
            container.tracing().shutdown()

    return run
