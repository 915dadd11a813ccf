"""What the HTTP app does when it starts and stops (``run`` also starts the worker in-process)."""

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

from fastapi import FastAPI

from ..container import Container, startup_diagnostics
from .stopping import FORCE_EXIT_STATE, stop_within_deadline


def lifespan(
    container: Container, *, with_worker: bool
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app's lifespan: start-up diagnostics, the bus connected (and, for ``run``, the worker
    started), and everything stopped in order, within a deadline, on shutdown."""

    @asynccontextmanager
    async def run(app: FastAPI) -> AsyncIterator[None]:
        startup_diagnostics(container)
        bus = container.bus()
        await bus.start()
        worker = container.worker() if with_worker else None
        if worker is not None:
            await worker.start()
        try:
            yield
        finally:
            force_exit = bool(getattr(app.state, FORCE_EXIT_STATE, False))
            await stop_within_deadline(container, worker, force_exit=force_exit)

    return run
