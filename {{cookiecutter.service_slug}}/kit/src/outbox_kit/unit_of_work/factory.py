"""Creates units of work and holds what they share (built once by the container).

It implements ``Shared`` for its units of work and the contexts' ``UnitOfWorkFactory``
Protocol for entry points. What runs after a commit comes in as an ``AfterCommit`` (the
in-process dispatcher), never imported from the floor above.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy.exc import DBAPIError

from ..application.unit_of_work import Adapter
from ..kernel.clock import Clock
from ..persistence.database import Database
from .capture import RelayWriter
from .shared import AfterCommit
from .unit_of_work import SqlUnitOfWork

log = logging.getLogger(__name__)


class UnitOfWorkFactory:
    """``factory()`` gives a new, unopened unit of work."""

    def __init__(
        self,
        *,
        database: Database,
        writer: RelayWriter,
        after_commit: AfterCommit,
        clock: Clock,
        wake: Callable[[], None],
        outbox_enabled: bool,
        adapters: Mapping[type[Any], Adapter] | None = None,
    ) -> None:
        self.database = database
        self.writer = writer
        self.after_commit = after_commit
        self.clock = clock
        self.wake = wake
        self.outbox_enabled = outbox_enabled
        self.adapters: Mapping[type[Any], Adapter] = dict(adapters or {})
        self.transient_retry_attempts = database.settings.transient_retry_attempts

    def __call__(self, *, depth: int = 0) -> SqlUnitOfWork:
        return SqlUnitOfWork(self, depth=depth)

    async def transient_pause(self, attempt: int, error: DBAPIError) -> None:
        log.warning(
            "transient database error, re-running the operation (attempt %s/%s): %s",
            attempt,
            self.transient_retry_attempts,
            error.orig,
        )
        await asyncio.sleep(0.05 * 2 ** (attempt - 1))
