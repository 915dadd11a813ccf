"""The outbox's fitness rules over this service and its kit (the rules are the kit's,
``outbox_kit.testing.FitnessRules``; their own tests, negative probes included, run with the kit):

* only the outbox processor publishes, and only the transports import a broker client;
* every integration event has a stable, versioned, unique name, declared on the class and
  registered, and pinned in ``message_names*.txt`` beside this file (a golden list: a new name is
  added there on purpose; a listed name nothing declares or upcasts any more fails, because
  stored rows and other services' consumers still carry it);
* every consumer goes through the inbox pipeline;
* an event with ``ordered=True`` is an aggregate's event, built with its ``aggregate_id``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from outbox_kit.testing import FitnessRules, golden_list_problems, pinned_names, service_fitness
from outbox_kit.testing.fixtures import make_settings

from {{ cookiecutter.package_name }}.container import build_container

pytestmark = pytest.mark.architecture
GOLDEN_NAMES = sorted(Path(__file__).parent.glob("message_names*.txt"))


@pytest.fixture(scope="module")
def rules() -> FitnessRules:
    return service_fitness(build_container.__module__.partition(".")[0])


def registry() -> Any:
    """This service's message registry (its contexts' messages and upcasters)."""
    return build_container(make_settings("sqlite+aiosqlite:///unused.db")).registry()


def assert_none(found: list[str], rule: str) -> None:
    assert not found, f"{rule}:\n  " + "\n  ".join(found)


def test_only_the_outbox_processor_and_the_transports_publish(rules: FitnessRules) -> None:
    assert_none(rules.publishes_outside_the_outbox(), "Only the outbox processor publishes (enqueue instead)")
    assert_none(
        rules.broker_clients_outside_the_transports(),
        "Only the transports import a broker client (publish through the outbox, consume through a consumer)",
    )
    assert "outbox_kit/processor/deliverers.py" in rules.publishers()


def test_every_integration_event_has_a_stable_versioned_unique_name(rules: FitnessRules) -> None:
    problems, duplicates = rules.event_name_problems(registry())

    assert_none(problems, "Integration events need a stable, versioned name, declared and registered")
    assert_none(duplicates, "Integration event names must be unique")


def test_message_names_match_the_golden_list() -> None:
    unpinned, stranded = golden_list_problems(registry(), pinned_names(GOLDEN_NAMES))

    assert GOLDEN_NAMES, "tests/architecture/message_names.txt is missing"
    assert_none(unpinned, "New message names: add each to tests/architecture/message_names.txt")
    assert_none(
        stranded,
        "Pinned names nothing declares or upcasts any more: restore the class, or add the new "
        "version with an upcaster from the old name (Module.upcasters)",
    )


def test_every_consumer_goes_through_the_inbox(rules: FitnessRules) -> None:
    count, unwrapped = rules.subscriptions_not_wrapped()

    assert_none(rules.subscriptions_outside_the_transports(), "Only the transports subscribe to a broker")
    assert count > 0
    assert_none(unwrapped, "Every broker subscription runs through ConsumeWrapper.handler_for")
    assert_none(rules.consumer_handlers_called_outside_the_pipeline(), "Only the inbox runs a consumer")


def test_ordered_events_are_an_aggregates_events(rules: FitnessRules) -> None:
    outside_aggregates, never_raised = rules.ordered_domain_event_problems()
    without_field, without_key = rules.ordered_integration_event_problems()

    assert_none(outside_aggregates, "An ordered domain event is built only in <aggregate>._raise(...)")
    assert_none(never_raised, "An ordered domain event must be raised by an aggregate")
    assert_none(without_field, "An ordered integration event keeps its aggregate_id field")
    assert_none(without_key, "An ordered integration event is built with aggregate_id= (its ordering key)")
