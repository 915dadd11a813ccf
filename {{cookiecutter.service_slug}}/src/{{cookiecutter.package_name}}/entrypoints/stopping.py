"""The stop every process shares, bounded by a deadline: the worker (which closes the bus) or the
bus, then the database pool, then the last spans.

``OUTBOX__SHUTDOWN_TIMEOUT_SECONDS`` is the unit: the in-flight deliveries get it (see
``Worker.stop``) and closing the connections as long again; without a worker, closing alone.
What does not finish by then (a database line gone silent, a broker that never acknowledges the
close, a trace collector that never answers) is abandoned, and the server drops the connection
when it notices. A library that ignores the cancellation cannot hold the process either: the
process's own entrypoints ask for a forced exit ``FORCED_EXIT_GRACE_SECONDS`` past the deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading

from outbox_kit.application.observability import Tracing
from outbox_kit.runtime.worker import Worker

from ..container import Container

log = logging.getLogger(__name__)

# After the deadline: time for the event loop to unwind and the interpreter to exit normally.
FORCED_EXIT_GRACE_SECONDS = 2.0
# Set on an app's state by the process's own server (``serving.serve_app``), so its lifespan asks
# for the forced exit; an app served in a test never has it.
FORCE_EXIT_STATE = "force_exit_after_the_stop_deadline"


def stop_deadline_seconds(container: Container, *, with_worker: bool) -> float:
    """How long stopping may take (see the module docstring)."""
    timeout = container.settings().outbox.shutdown_timeout_seconds
    return 2 * timeout if with_worker else timeout


async def stop_within_deadline(container: Container, worker: Worker | None, *, force_exit: bool) -> None:
    """Stop everything within ``stop_deadline_seconds``; with ``force_exit`` (a process of its
    own, never a test's server) the process exits ``FORCED_EXIT_GRACE_SECONDS`` after it even if
    something swallowed the cancellation."""
    seconds = stop_deadline_seconds(container, with_worker=worker is not None)
    if force_exit:
        watchdog = threading.Timer(seconds + FORCED_EXIT_GRACE_SECONDS, _exit_now, args=(seconds,))
        watchdog.daemon = True  # the process ending normally ends it
        watchdog.start()
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


def _exit_now(seconds: float) -> None:
    """The watchdog: the stop outlived its deadline (a library kept waiting through the
    cancellation). Exit status 0: the stop was asked for, and what it abandoned is only
    connections (rows are released or wait out their lease)."""
    log.error(
        "shutdown: still running %g s after the %g s deadline (something ignored the cancellation); "
        "exiting now",
        FORCED_EXIT_GRACE_SECONDS,
        seconds,
    )
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    os._exit(0)


async def _shut_tracing_down(tracing: Tracing, deadline: float) -> None:
    """The last export blocks (up to the exporter's own timeout, ``OTEL_EXPORTER_OTLP_TIMEOUT``,
    when the collector does not answer), so it runs in a daemon thread, waited for until the
    deadline (a moment at least): one still hanging then does not hold the exit, and its spans
    are dropped."""
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
        async with asyncio.timeout(max(deadline - loop.time(), 0.1)):
            await finished
    except TimeoutError:
        log.warning("shutdown: the last spans were not exported in time (no answer from the collector)")
