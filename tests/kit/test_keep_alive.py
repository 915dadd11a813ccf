"""The heartbeat that keeps a message while its handler runs ends with the handler, whatever the
broker client does with a cancellation."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from outbox_kit.consume.subscribers import keep_alive

pytestmark = pytest.mark.unit


class SwallowingDelivery:
    """A delivery whose touch, like a broker client seen in the reliability tier, turns a
    cancellation landing inside its command into a normal return."""

    message_id = "m-1"
    heartbeat_seconds = 0.02

    def __init__(self, *, hang: bool = False) -> None:
        self.touches = 0
        self.hang = hang

    async def touch(self) -> None:
        self.touches += 1
        try:
            await asyncio.sleep(3600 if self.hang else 0.05)
        except asyncio.CancelledError:
            return  # swallowed


async def test_the_heartbeat_stops_with_the_handler_even_if_a_touch_swallows_a_cancel() -> None:
    delivery: Any = SwallowingDelivery()
    began = time.monotonic()
    async with keep_alive(delivery):
        await asyncio.sleep(0.2)  # the handler; several touches run meanwhile
    assert delivery.touches >= 2
    assert time.monotonic() - began < 1.5  # the block's exit did not wait on the heartbeat for ever
    touches = delivery.touches
    await asyncio.sleep(0.1)
    assert delivery.touches == touches, "the heartbeat went on after the handler ended"


async def test_a_hanging_touch_does_not_hold_the_handler_for_longer_than_a_second() -> None:
    delivery: Any = SwallowingDelivery(hang=True)
    began = time.monotonic()
    async with keep_alive(delivery):
        await asyncio.sleep(0.05)
    assert time.monotonic() - began < 1.5
