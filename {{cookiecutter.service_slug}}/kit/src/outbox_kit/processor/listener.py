"""The cross-replica wake: LISTEN on a dedicated asyncpg connection, turned into wake-ups; it
reconnects forever and wakes the loops once after every reconnect to catch up."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from outbox_kit.persistence.capture import WakeSignal

log = logging.getLogger(__name__)


class PostgresListener:
    """LISTEN on the outbox channel and turn notifications into wake-ups; reconnects forever.

    The connection is watched three ways: asyncpg's termination callback (the server closed it),
    a ``SELECT 1`` every ``keepalive_seconds`` that must answer within ``query_timeout_seconds``
    (a half-open socket, say after a failover behind a load balancer, never closes by itself),
    and any error while listening. Whatever ends a connection, the listener reconnects; the
    backoff only resets once a connection has stayed up for ``stable_seconds``, so a server that
    accepts and drops at once is retried at the capped pace, not twenty times a second. Every
    reconnect wakes the loops once, to catch up on what was committed in between.
    """

    def __init__(
        self,
        dsn: str,
        channel: str,
        wake: WakeSignal,
        *,
        initial_backoff: float = 0.05,
        max_backoff: float = 5.0,
        keepalive_seconds: float = 30.0,
        query_timeout_seconds: float = 10.0,
        stable_seconds: float = 10.0,
    ) -> None:
        self._dsn = dsn
        self._channel = channel
        self._wake = wake
        self._initial_backoff = initial_backoff
        self._max_backoff = max_backoff
        self._keepalive = keepalive_seconds
        self._query_timeout = query_timeout_seconds
        self._stable = stable_seconds
        self.connected = asyncio.Event()
        self.notifications = 0
        self.connections = 0

    def _on_notify(self, *_args: object) -> None:
        self.notifications += 1
        self._wake.set()

    async def run(self) -> None:
        """Listen until cancelled; reconnect with backoff when the connection drops."""
        import asyncpg  # noqa: PLC0415 (only PostgreSQL deployments need it)

        backoff = self._initial_backoff
        while True:
            try:
                connection = await asyncpg.connect(self._dsn, timeout=self._query_timeout)
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as error:
                log.warning("outbox listener cannot connect (%s); retrying in %.2fs", error, backoff)
            else:
                self.connections += 1
                connected_at = time.monotonic()
                await self._listen(connection)
                if time.monotonic() - connected_at >= self._stable:
                    backoff = self._initial_backoff
                    continue  # it was up long enough: reconnect at once
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self._max_backoff)

    async def _listen(self, connection: Any) -> None:  # noqa: ANN401 (asyncpg.Connection, imported lazily)
        lost = asyncio.Event()
        try:
            connection.add_termination_listener(lambda _conn: lost.set())
            await connection.add_listener(self._channel, self._on_notify)
            self.connected.set()
            self._wake.set()  # catch up on whatever was committed while we were away
            while not lost.is_set() and not connection.is_closed():
                try:
                    await asyncio.wait_for(lost.wait(), timeout=self._keepalive)
                except TimeoutError:
                    # A half-open socket answers nothing: the timeout is what detects it.
                    await connection.execute("SELECT 1", timeout=self._query_timeout)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 (any failure means: reconnect)
            log.warning("outbox listener lost its connection: %s: %s", type(error).__name__, error)
        finally:
            self.connected.clear()
            await _close_quietly(connection, self._query_timeout)


async def _close_quietly(connection: Any, within_seconds: float) -> None:  # noqa: ANN401 (asyncpg.Connection)
    """Close, or drop the socket when a polite close cannot finish (the peer is gone)."""
    if connection.is_closed():
        return
    try:
        await connection.close(timeout=within_seconds)
    except Exception:  # noqa: BLE001 (the connection is being discarded either way)
        connection.terminate()
