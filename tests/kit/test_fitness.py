"""The outbox's fitness rules (``outbox_kit.testing.FitnessRules``) hold on the kit alone, and
none is vacuous: a probe package breaks the publish rules at each line, the golden list catches
a rename and a new name but not an upcast version, and the buses reach the consume pipeline.
A service runs the same rules over its own code and the kit (its ``test_outbox_fitness.py``)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from outbox_kit.application.messages import IntegrationEvent, MessageRegistry
from outbox_kit.runtime.container import OutboxContainer
from outbox_kit.testing import CallGraph, FitnessRules, golden_list_problems, source_index
from outbox_kit.transports.in_process import InProcessBus

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def kit_rules() -> FitnessRules:
    return FitnessRules(CallGraph(source_index(("outbox_kit",))))


def test_the_kit_keeps_its_own_fitness_rules(kit_rules: FitnessRules) -> None:
    assert kit_rules.publishes_outside_the_outbox() == []
    assert kit_rules.broker_clients_outside_the_transports() == []
    assert kit_rules.subscriptions_outside_the_transports() == []
    count, unwrapped = kit_rules.subscriptions_not_wrapped()
    assert count > 0
    assert unwrapped == []
    assert kit_rules.consumer_handlers_called_outside_the_pipeline() == []
    assert "outbox_kit/processor/deliverers.py" in kit_rules.publishers()


def test_a_broker_delivery_reaches_the_consume_pipeline(kit_rules: FitnessRules) -> None:
    """The broker's way in, statically; the in-process bus is handed the pipeline's ``consume``
    by the container (the next test)."""
    consume = "outbox_kit.consume.inbox.ConsumePipeline.consume"
    assert kit_rules.reaches("outbox_kit.consume.subscribers.ConsumeWrapper.handler_for", consume)


def test_a_publish_or_a_broker_client_outside_the_allowed_files_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A probe service that publishes from its application layer, by the bus and by a raw
    client, is reported at each line."""
    package = f"publish_probe_{uuid.uuid4().hex[:8]}"
    kit = f"{package}_kit"
    files = {
        f"{kit}/__init__.py": "",
        f"{kit}/transports/__init__.py": "",
        f"{kit}/transports/rabbit.py": "import aio_pika\n",
        f"{package}/__init__.py": "",
        f"{package}/billing/__init__.py": "",
        f"{package}/billing/application.py": (
            "import redis.asyncio\n"
            "from faststream.rabbit import RabbitBroker\n\n\n"
            "async def bill(bus, client):\n"
            "    await bus.publish('billed')\n"
            "    await client.xadd('billing', {'x': 1})\n"
        ),
    }
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    probe = FitnessRules(CallGraph(source_index((package, kit))), kit=kit)

    assert probe.publishes_outside_the_outbox() == [f"{package}/billing/application.py:6: bus.publish"]
    assert probe.broker_clients_outside_the_transports() == [
        f"{package}/billing/application.py:1: import redis.asyncio",
        f"{package}/billing/application.py:2: from faststream.rabbit import RabbitBroker",
    ]


class ShipmentSentV2(IntegrationEvent, name="probe.shipment-sent.v2"):
    parcel: str


class ParcelWeighedV1(IntegrationEvent, name="probe.parcel-weighed.v1"):
    grams: int


def test_the_golden_list_catches_a_rename_and_a_new_name_but_not_an_upcast_version() -> None:
    registry = MessageRegistry()
    registry.register(ShipmentSentV2, ParcelWeighedV1)
    pinned = {
        "probe.shipment-sent.v1": "message_names.txt",
        "probe.shipment-sent.v2": "message_names.txt",
        "probe.parcel-weighed.v0": "message_names.txt",
    }

    unpinned, stranded = golden_list_problems(registry, pinned)
    assert unpinned == ["probe.parcel-weighed.v1"]
    assert stranded == [
        "probe.parcel-weighed.v0 (message_names.txt)",
        "probe.shipment-sent.v1 (message_names.txt)",
    ]

    registry.add_upcaster("probe.shipment-sent.v1", "probe.shipment-sent.v2", lambda payload: payload)
    assert golden_list_problems(registry, pinned)[1] == ["probe.parcel-weighed.v0 (message_names.txt)"]


def test_the_in_process_bus_delivers_through_the_container_pipeline(container: OutboxContainer) -> None:
    bus = container.bus()

    assert isinstance(bus, InProcessBus)
    assert bus._consume == container.pipeline().consume  # the same pipeline's bound method
