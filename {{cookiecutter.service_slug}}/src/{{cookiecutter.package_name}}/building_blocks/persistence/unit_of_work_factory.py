"""Creates units of work and holds what they share (built once by the container)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy.exc import DBAPIError

from ..clock import Clock
from ..outbox.capture import OutboxWriter
from ..outbox.dispatch import LocalDispatcher
from .database import Database
from .unit_of_work import UnitOfWork

log = logging.getLogger(__name__)


class UnitOfWorkFactory:
    """``factory()`` gives a new, unopened unit of work."""

    def __init__(
        self,
        *,
        database: Database,
        writer: OutboxWriter,
        dispatcher: LocalDispatcher,
        clock: Clock,
        wake: Callable[[], None],
        outbox_enabled: bool,
        adapters: Mapping[type[Any], Callable[[UnitOfWork], Any]] | None = None,
    ) -> None:
        self.database = database
        self.writer = writer
        self.dispatcher = dispatcher
        self.clock = clock
        self.wake = wake
        self.outbox_enabled = outbox_enabled
        self.adapters: Mapping[type[Any], Callable[[UnitOfWork], Any]] = dict(adapters or {})
        self.transient_retry_attempts = database.settings.transient_retry_attempts
        dispatcher.bind(self)

    def __call__(self, *, depth: int = 0) -> UnitOfWork:
        return UnitOfWork(self, depth=depth)

    async def transient_pause(self, attempt: int, error: DBAPIError) -> None:
        log.warning(
            "transient database error, re-running the operation (attempt %s/%s): %s",
            attempt,
            self.transient_retry_attempts,
            error.orig,
        )
        await asyncio.sleep(0.05 * 2 ** (attempt - 1))
