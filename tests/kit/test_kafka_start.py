"""The Kafka transport starts its subscribers together (no broker needed: their start is faked).

Each subscriber's start waits until its consumer group has assigned it partitions, which a broker
holds back for a while (Kafka's ``group.initial.rebalance.delay.ms``). Started one after another,
a service with n consumers (a topic and a retry topic each) waited 2n such rounds."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest
from outbox_kit.testing.fixtures import make_settings
from outbox_kit.testing.harness import CounterChangedV1, install_kit
from outbox_kit.transports.kafka import (
    KafkaTransport,
)

pytestmark = pytest.mark.unit


async def test_every_subscriber_is_starting_before_any_has_finished(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from outbox_kit.testing.fixtures import kit_container

    container = kit_container(
        make_settings(sqlite_url, message_bus={"transport": "kafka", "url": "127.0.0.1:1"})
    )
    await install_kit(container)

    async def observe(event: CounterChangedV1, uow: Any) -> None:
        del event, uow

    container.handlers().consume("kit.observer", CounterChangedV1, observe)
    transport = cast("KafkaTransport", container.bus())
    subscribers = list(transport.broker.subscribers)
    assert len(subscribers) >= 2
    starting: list[object] = []
    everyone_starting = asyncio.Event()

    async def waits_for_its_group(subscriber: object) -> None:
        starting.append(subscriber)
        if len(starting) == len(subscribers):
            everyone_starting.set()
        await asyncio.wait_for(everyone_starting.wait(), 5)  # one after another: times out

    async def connected() -> None:
        return None

    monkeypatch.setattr(transport.broker, "connect", connected)
    for subscriber in subscribers:
        monkeypatch.setattr(subscriber, "start", lambda s=subscriber: waits_for_its_group(s))
    try:
        await transport.start_consuming()
        assert transport.broker.running
        assert sorted(map(id, starting)) == sorted(map(id, subscribers))
    finally:
        await container.database().dispose()
