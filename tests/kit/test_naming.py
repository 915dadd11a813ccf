"""Broker names: every name carries the namespace, the cutover switch drops it, and no unsafe
character reaches a broker."""

from __future__ import annotations

import pytest
from outbox_kit.transports.settings import EndpointNames

pytestmark = pytest.mark.unit


def test_every_name_carries_the_namespace() -> None:
    names = EndpointNames("shop")
    assert names.channel("orders.order-placed.v1") == "shop.orders.order-placed.v1"
    assert names.exchange() == "shop.events"
    assert names.queue("notifications.order-placed") == "shop.consumer.notifications.order-placed"
    assert names.retry_queue("n") == "shop.consumer.n.retry"
    assert names.dead_letters("n") == "shop.consumer.n.dlq"
    assert names.dead_letter_subject("n") == "dlq.shop.consumer.n"
    assert names.stream("events") == "SHOP_EVENTS"


def test_preserving_default_names_drops_the_prefix_everywhere() -> None:
    names = EndpointNames("shop", preserve_default_names=True)
    assert names.channel("orders.order-placed.v1") == "orders.order-placed.v1"
    assert names.exchange() == "events"
    assert names.queue("n") == "consumer.n"
    assert names.stream("events") == "EVENTS"


def test_unsafe_characters_never_reach_the_broker() -> None:
    names = EndpointNames("my shop/eu*")
    assert names.channel("a.b.v1") == "my-shop-eu-.a.b.v1"
    assert names.stream("dead_letters") == "MY_SHOP_EU__DEAD_LETTERS"
