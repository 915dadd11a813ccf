"""A service process's start-up objects kept out of the garbage collector's full collections.

A started process holds a few hundred thousand objects that live as long as it does: modules,
classes, pydantic and SQLAlchemy metadata, the container. CPython's oldest generation is
collected when enough objects have survived into it since the last full collection. Each of
those collections then walks all of them, and it stops every coroutine of the process while it
runs. ``make bench`` saw 100-160 ms pauses every few seconds in the worker, the consumer and the
writer at 100 events per second. Those pauses made the tail of commit to handler, 124-130 ms at
the 99th percentile, against 16-17 ms at the median.

:func:`freeze_start_up_heap` runs once, when a process has started. It collects once, then moves
every surviving object to the permanent generation (``gc.freeze``), which no collection walks.
Objects made later are collected as before. A start-up object that dies later is still freed
by its reference count; only one caught in a reference cycle stays, which start-up objects
almost never are.

Only a process of its own calls it: ``outbox worker`` once its worker has started, and the
lifespan of an app served by ``runtime.server`` (``outbox run``, ``outbox api``, ``outbox
worker --port``) once the app has started. An app in a test leaves the test runner's collector
alone. ``make bench``'s worker, consumer and writer freeze theirs as the service's processes do.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def freeze_start_up_heap() -> int:
    """Collect, then freeze every object alive now; the number of objects frozen in all."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("start-up heap frozen: %d objects left out of the garbage collector's full collections", frozen)
    return frozen
