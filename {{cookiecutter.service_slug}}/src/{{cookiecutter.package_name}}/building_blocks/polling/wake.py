"""What wakes a processor early: the in-process signal and PostgreSQL NOTIFY.

Committing transactions on PostgreSQL send one ``NOTIFY`` (delivered only on commit); every
replica ``LISTEN``s on a dedicated asyncpg connection, never inside a transaction (a listener in
an open transaction receives nothing until it ends). Notifications sent while the listener was
disconnected are lost, so each (re)connect triggers one catch-up wake, and the fallback interval
remains the safety net: NOTIFY is a hint, never the only path.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger(__name__)


class WakeSignal:
    """A set of events, one per polling loop; ``set()`` wakes all of them."""

    def __init__(self) -> None:
        self._events: list[asyncio.Event] = []
        self.count = 0

    def subscribe(self) -> asyncio.Event:
        event = asyncio.Event()
        self._events.append(event)
        return event

    def set(self) -> None:
        self.count += 1
        for event in self._events:
            event.set()


class PostgresListener:
    """LISTEN on the outbox channel and turn notifications into wake-ups; reconnects forever."""

    def __init__(
        self,
        dsn: str,
        channel: str,
        wake: WakeSignal,
        *,
        initial_backoff: float = 0.05,
        max_backoff: float = 5.0,
    ) -> None:
        self._dsn = dsn
        self._channel = channel
        self._wake = wake
        self._initial_backoff = initial_backoff
        self._max_backoff = max_backoff
        self.connected = asyncio.Event()
        self.notifications = 0

    def _on_notify(self, *_args: object) -> None:
        self.notifications += 1
        self._wake.set()

    async def run(self) -> None:
        """Listen until cancelled; reconnect with backoff when the connection drops."""
        import asyncpg  # noqa: PLC0415 (only PostgreSQL deployments need it)

        backoff = self._initial_backoff
        while True:
            try:
                connection = await asyncpg.connect(self._dsn)
            except (OSError, asyncpg.PostgresError) as error:
                log.warning("outbox listener cannot connect (%s); retrying in %.2fs", error, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self._max_backoff)
                continue
            backoff = self._initial_backoff
            await self._listen(connection)

    async def _listen(self, connection: Any) -> None:  # noqa: ANN401 (asyncpg.Connection, imported lazily)
        import asyncpg  # noqa: PLC0415

        lost = asyncio.Event()
        try:
            connection.add_termination_listener(lambda _conn: lost.set())
            await connection.add_listener(self._channel, self._on_notify)
            self.connected.set()
            self._wake.set()  # catch up on whatever was committed while we were away
            while not lost.is_set() and not connection.is_closed():
                try:
                    await asyncio.wait_for(lost.wait(), timeout=30)
                except TimeoutError:
                    await connection.execute("SELECT 1")  # detect a silent half-open socket
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as error:
            log.warning("outbox listener lost its connection: %s", error)
        finally:
            self.connected.clear()
            if not connection.is_closed():
                await connection.close(timeout=2)
