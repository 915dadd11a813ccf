"""A delivery slot: one of ``delivery_concurrency`` publishes (or handler runs) in flight.

A row gives its slot back as soon as its delivery ended, before its stamp is written: the stamp
waits for its group (``stamps``), and a slot held through that wait would idle the broker.
"""

from __future__ import annotations

import asyncio
from types import TracebackType


class DeliverySlot:
    """Held from the start of a row's delivery until ``free()`` or the end of the row."""

    def __init__(self, gate: asyncio.Semaphore) -> None:
        self._gate = gate
        self._held = False

    async def __aenter__(self) -> DeliverySlot:
        await self._gate.acquire()
        self._held = True
        return self

    def free(self) -> None:
        """Let the next row start; idempotent."""
        if self._held:
            self._held = False
            self._gate.release()

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.free()
