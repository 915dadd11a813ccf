"""The AsyncAPI document: public, so it names hosts without credentials, and it lists what the
service publishes and consumes."""

from __future__ import annotations

import json

import pytest
from outbox_kit.application.handlers import HandlerRegistry
from outbox_kit.application.messages import MessageRegistry
from outbox_kit.public import IntegrationEvent
from outbox_kit.runtime.app import asyncapi_document, public_server
from outbox_kit.transports.settings import MessageBusSettings

pytestmark = pytest.mark.unit


class CounterChangedV1(IntegrationEvent, name="kit.counter-changed.v1", ordered=True):
    """A counter's new value."""

    counter_id: str
    value: int


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("amqp://orders:s3cret@rabbit.internal:5672/prod?heartbeat=30", ("rabbit.internal:5672", "/prod")),
        ("redis://:s3cret@cache:6379/0?password=s3cret", ("cache:6379", "/0")),
        ("nats://token-s3cret@nats-1:4222", ("nats-1:4222", None)),
        ("svc:s3cret@kafka-1:9092,kafka-2:9092", ("kafka-1:9092,kafka-2:9092", None)),
        ("kafka-1:9092", ("kafka-1:9092", None)),
    ],
)
def test_the_server_entry_names_hosts_but_never_credentials(
    url: str, expected: tuple[str, str | None]
) -> None:
    server = public_server(url, "amqp")
    assert (server["host"], server.get("pathname")) == expected
    assert "s3cret" not in json.dumps(server)


def test_the_document_has_a_channel_per_event_and_a_receive_operation_per_consumer() -> None:
    registry = MessageRegistry()
    registry.register(CounterChangedV1)
    handlers = HandlerRegistry()

    async def observe(event: CounterChangedV1, uow: object) -> None:
        del event, uow

    handlers.consume("kit.observer", CounterChangedV1, observe)  # type: ignore[arg-type]
    bus = MessageBusSettings(transport="rabbitmq", url="amqp://orders:s3cret@rabbit:5672/")
    document = asyncapi_document(
        registry,
        handlers,
        bus,
        namespace="shop",
        title="Shop",
        description="Sells things",
    )
    assert "s3cret" not in json.dumps(document)
    assert document["servers"]["default"] == {"host": "rabbit:5672", "protocol": "rabbitmq"}
    channel = document["channels"]["kit_counter_changed_v1"]
    assert channel["address"] == "shop.kit.counter-changed.v1"
    operations = document["operations"]
    assert operations["publish_kit_counter_changed_v1"]["action"] == "send"
    receive = operations["consume_kit_observer"]
    assert receive["action"] == "receive"
    assert receive["channel"] == {"$ref": "#/channels/kit_counter_changed_v1"}
    payload = document["components"]["messages"]["kit_counter_changed_v1"]["payload"]
    assert set(payload["properties"]) >= {"counter_id", "value"}
    assert document["info"] == {"title": "Shop", "version": "1.0.0", "description": "Sells things"}
