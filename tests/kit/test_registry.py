"""Stored names resolve back to classes; upcasters read old payloads as new versions."""

from dataclasses import dataclass
from typing import Any

import pytest
from outbox_kit.application.messages import (
    IntegrationEvent,
    MalformedPayloadError,
    MessageRegistry,
    RegistryError,
    UnknownMessageError,
)
from outbox_kit.domain import (
    DomainEvent,
)

pytestmark = pytest.mark.unit


class PriceChangedV3(IntegrationEvent, name="catalog.price-changed.v3"):
    sku: str
    amount_cents: int
    currency: str


@dataclass(frozen=True, kw_only=True)
class Shipped(DomainEvent, name="shipping.shipped.v1"):
    carrier: str


def v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    return {"sku": payload["product"], "amount": payload["price"]}


def v2_to_v3(payload: dict[str, Any]) -> dict[str, Any]:
    return {"sku": payload["sku"], "amount_cents": round(float(payload["amount"]) * 100), "currency": "EUR"}


def registry() -> MessageRegistry:
    r = MessageRegistry()
    r.register(PriceChangedV3, Shipped)
    r.add_upcaster("catalog.price-changed.v1", "catalog.price-changed.v2", v1_to_v2)
    r.add_upcaster("catalog.price-changed.v2", "catalog.price-changed.v3", v2_to_v3)
    r.validate()
    return r


def test_upcaster_chain_reads_a_v1_payload_as_v3() -> None:
    loaded = registry().load("catalog.price-changed.v1", {"product": "BOOK", "price": "9.99"})
    assert loaded == PriceChangedV3(
        sku="BOOK", amount_cents=999, currency="EUR", event_id=loaded.event_id, occurred_on=loaded.occurred_on
    )


def test_dump_and_load_round_trip_domain_events() -> None:
    event = Shipped(aggregate_id="o-1", carrier="DHL")
    r = registry()
    assert r.load("shipping.shipped.v1", r.dump(event)) == event


def test_unknown_names_and_bad_payloads_are_reported() -> None:
    r = registry()
    with pytest.raises(UnknownMessageError, match="no registered message is named 'nope.thing.v1'"):
        r.load("nope.thing.v1", {})
    with pytest.raises(MalformedPayloadError, match="does not validate") as malformed:
        r.load("catalog.price-changed.v3", {"sku": "x", "amount_cents": "alice@example.com"})
    # The message lands in last_error, which operators read: field paths and reasons, no values.
    assert "amount_cents: Input should be a valid integer" in str(malformed.value)
    assert "currency: Field required" in str(malformed.value)
    assert "alice@example.com" not in str(malformed.value)


def test_duplicate_names_are_refused_at_start_up() -> None:
    class Other(IntegrationEvent, name="catalog.price-changed.v3"):
        pass

    r = MessageRegistry()
    r.register(PriceChangedV3)
    with pytest.raises(RegistryError, match="declared by both"):
        r.register(Other)


def test_upcaster_cycles_duplicates_and_dead_ends_are_refused() -> None:
    r = MessageRegistry()
    r.register(PriceChangedV3)
    r.add_upcaster("catalog.a.v1", "catalog.a.v2", v1_to_v2)
    with pytest.raises(RegistryError, match="registered twice"):
        r.add_upcaster("catalog.a.v1", "catalog.a.v3", v1_to_v2)
    r.add_upcaster("catalog.a.v2", "catalog.a.v1", v1_to_v2)
    with pytest.raises(RegistryError, match="loops"):
        r.validate()
    dead_end = MessageRegistry()
    dead_end.add_upcaster("catalog.b.v1", "catalog.b.v2", v1_to_v2)
    with pytest.raises(RegistryError, match="which no class declares"):
        dead_end.validate()
    shadowing = MessageRegistry()
    shadowing.register(PriceChangedV3)
    shadowing.add_upcaster("catalog.price-changed.v3", "catalog.price-changed.v4", v1_to_v2)
    with pytest.raises(RegistryError, match="would be upcast and never read as that class"):
        shadowing.validate()


def test_the_container_refuses_inconsistent_modules_at_start_up() -> None:
    """``build_registry`` is what start-up runs: it validates after every module registered."""
    from outbox_kit.application.handlers import Module, UpcasterSpec
    from outbox_kit.runtime.container import build_registry

    looping = Module(
        name="catalog",
        messages=[PriceChangedV3],
        upcasters=[
            UpcasterSpec("catalog.x.v1", "catalog.x.v2", v1_to_v2),
            UpcasterSpec("catalog.x.v2", "catalog.x.v1", v1_to_v2),
        ],
    )
    with pytest.raises(RegistryError, match="loops"):
        build_registry([looping])
    with pytest.raises(RegistryError, match="declared by both"):
        build_registry([Module(name="one", messages=[Shipped]), Module(name="two", messages=[ShippedAgain])])


@dataclass(frozen=True, kw_only=True)
class ShippedAgain(DomainEvent, name="shipping.shipped.v1"):
    carrier: str
