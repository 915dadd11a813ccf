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

import sqlalchemy as sa

log = logging.getLogger(__name__)


def wake_replicas(channel: str) -> sa.Select[Any]:
    """``SELECT pg_notify(channel, '')``: run inside a transaction, PostgreSQL delivers it to
    every listening replica only if that transaction commits (so a wake never outruns its data)."""
    return sa.select(sa.func.pg_notify(channel, ""))


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
