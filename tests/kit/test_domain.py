"""Aggregates change only through applied events; events carry stable names and keys."""

from dataclasses import dataclass

import pytest
from outbox_kit.application.messages import IntegrationEvent, InternalCommand
from outbox_kit.domain import (
    MAX_ORDERING_KEY_LENGTH,
    AggregateRoot,
    DomainEvent,
    OrderingKeyTooLongError,
    applies,
    validate_event_name,
)

pytestmark = pytest.mark.unit


@dataclass(frozen=True, kw_only=True)
class Renamed(DomainEvent, name="tests.renamed.v1", ordered=True):
    new_name: str


@dataclass(frozen=True, kw_only=True)
class Noted(DomainEvent, name="tests.noted.v1"):
    text: str


class Thing(AggregateRoot):
    def __init__(self, thing_id: str) -> None:
        super().__init__(thing_id)
        self.name = ""
        self.notes: list[str] = []

    def rename(self, name: str) -> None:
        self._raise(Renamed(aggregate_id=self.id, new_name=name))

    def note(self, text: str) -> None:
        self._raise(Noted(aggregate_id=self.id, text=text))

    @applies(Renamed)
    def _renamed(self, event: Renamed) -> None:
        self.name = event.new_name

    @applies(Noted)
    def _noted(self, event: Noted) -> None:
        self.notes.append(event.text)


def test_raising_an_event_applies_it_and_keeps_it_pending_in_order() -> None:
    thing = Thing("t-1")
    thing.rename("first")
    thing.note("hello")
    assert thing.name == "first"
    assert thing.notes == ["hello"]
    assert [type(e) for e in thing.pending_events] == [Renamed, Noted]


def test_remove_events_drops_exactly_the_captured_ones() -> None:
    thing = Thing("t-1")
    thing.rename("a")
    captured = thing.pending_events
    thing.note("raised after the capture")
    thing.remove_events(captured)
    assert [type(e) for e in thing.pending_events] == [Noted]


def test_an_event_without_an_applier_is_refused() -> None:
    class Bare(AggregateRoot):
        pass

    with pytest.raises(TypeError, match="no @applies"):
        Bare("b")._raise(Noted(aggregate_id="b", text="x"))


def test_names_versions_and_ordering_keys() -> None:
    assert Renamed.message_name == "tests.renamed.v1"
    assert Renamed(aggregate_id="k", new_name="n").ordering_key() == "k"
    assert Noted(aggregate_id="k", text="t").ordering_key() is None
    for bad in ("Orders.Placed.v1", "orders.placed", "orders.placed.v0", "placed.v1", "orders placed.v1"):
        with pytest.raises(ValueError, match="must look like"):
            validate_event_name(bad)


def test_entities_are_equal_by_identity() -> None:
    assert Thing("a") == Thing("a")
    assert Thing("a") != Thing("b")
    assert len({Thing("a"), Thing("a")}) == 1


def test_an_ordering_key_longer_than_the_limit_is_refused_when_the_event_is_made() -> None:
    """The key is stored with its kind in a bounded column: refused here, with the limit named,
    rather than by the database at commit (a 500 on PostgreSQL, silently kept on SQLite)."""
    longest = "k" * MAX_ORDERING_KEY_LENGTH
    assert Renamed(aggregate_id=longest, new_name="fits").ordering_key() == longest
    with pytest.raises(OrderingKeyTooLongError, match=f"at most {MAX_ORDERING_KEY_LENGTH} characters"):
        Renamed(aggregate_id=longest + "k", new_name="too long")
    assert Noted(aggregate_id=longest * 2, text="unordered: no key, no limit").ordering_key() is None


def test_integration_events_and_commands_refuse_an_over_long_key_too() -> None:
    class Shipped(IntegrationEvent, name="tests.shipped.v1", ordered=True):
        pass

    class Remind(InternalCommand, name="tests.remind.v1"):
        customer: str

        def ordering_key(self) -> str | None:
            return self.customer

    with pytest.raises(OrderingKeyTooLongError, match="tests.shipped.v1"):
        Shipped(aggregate_id="s" * 200)
    with pytest.raises(OrderingKeyTooLongError, match="tests.remind.v1"):
        Remind(customer="c" * 200)
