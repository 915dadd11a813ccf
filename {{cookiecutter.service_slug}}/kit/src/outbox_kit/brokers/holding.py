"""Keeping a message while its handler works, and through a database outage.

While a handler runs, ``keep_alive`` touches the message so the broker does not hand it to
another consumer (NATS ``in_progress``, Redis ``XCLAIM JUSTID``). A database outage says nothing
about the message: charging it an attempt would dead-letter every message in flight during a
failover, so it is held and run again, uncharged, with a capped backoff for up to
``MESSAGE_BUS__DATABASE_OUTAGE_HOLD_SECONDS``; a longer outage falls through to the normal,
charged redelivery. Each run rolls back in full, so running again is exactly a redelivery.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from ..application.handler_types import Consumer
from ..inbox.pipeline import ConsumePipeline
from ..kernel.metrics import RelayMetrics
from ..kernel.time_limits import time_limit
from ..persistence.outages import is_database_outage
from .transports.ports import Delivery

log = logging.getLogger(__name__)
OUTAGE_FIRST_PAUSE_SECONDS = 0.2
OUTAGE_MAX_PAUSE_SECONDS = 5.0


@asynccontextmanager
async def keep_alive(delivery: Delivery) -> AsyncIterator[None]:
    """While the block runs, ``touch`` the message so the broker does not hand it to another
    consumer (NATS ``in_progress``, Redis ``XCLAIM JUSTID``); a no-op where not needed.

    The heartbeat is stopped by an event, not by cancelling it: a broker client may swallow a
    cancellation that lands inside its command (redis-py was seen to), and a heartbeat awaited
    after such a cancel beat on for ever while the handler, done, waited for it: the consumer
    stalled with its messages pending. A touch that hangs is abandoned after one interval.
    """
    interval = delivery.heartbeat_seconds
    if interval is None:
        yield
        return
    stopped = asyncio.Event()

    async def beat() -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopped.wait(), timeout=interval)
                return
            try:
                await delivery.touch()
            except Exception:
                log.warning("could not extend message %s", delivery.message_id, exc_info=True)

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        stopped.set()
        _, hanging = await asyncio.wait({task}, timeout=max(interval, 1.0))
        for touch in hanging:
            touch.cancel()  # not awaited: it must not hold the message's outcome


async def consume_through_database_outages(
    pipeline: ConsumePipeline,
    metrics: RelayMetrics,
    hold_seconds: float,
    consumer: Consumer[Any],
    delivery: Delivery,
    *,
    handler_timeout_seconds: float,
) -> None:
    """Run the pipeline; while the database is unreachable, hold the message and run it again.

    A database outage says nothing about the message: charging it an attempt would
    dead-letter every message in flight during a failover. The message is held (kept alive
    at the broker) with a capped backoff for up to ``DATABASE_OUTAGE_HOLD_SECONDS``; a longer
    outage falls through to the normal, charged redelivery. Each run rolls back in full, so
    running again is exactly a redelivery.

    Each run is limited to ``MESSAGE_BUS__HANDLER_TIMEOUT_SECONDS``: a handler past it is
    cancelled (its unit of work rolls back) and the run fails with ``TimeLimitExceededError``, a
    handler failure like any other (redelivered, then dead-lettered), so one message that hangs
    cannot stop its consumer (or, on Kafka, its partition). A hold between runs is not counted."""
    deadline = time.monotonic() + hold_seconds
    pause = OUTAGE_FIRST_PAUSE_SECONDS
    while True:
        try:
            async with time_limit(handler_timeout_seconds, "handler"):
                await pipeline.consume(consumer, delivery.headers, delivery.body)
        except Exception as error:
            if not is_database_outage(error) or time.monotonic() + pause > deadline:
                raise
            metrics.inbox_outage_holds.labels(consumer.name).inc()
            log.warning(
                "%s: database unreachable while handling %s; holding it %.1fs (not charged): %s",
                consumer.name,
                delivery.message_id,
                pause,
                error,
            )
            await asyncio.sleep(pause)
            pause = min(pause * 2, OUTAGE_MAX_PAUSE_SECONDS)
        else:
            return
