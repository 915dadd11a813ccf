"""The reliability tier (``make test-reliability``): the kit's fault-injection scenarios and its
model of the relay protocol, run against this service's own container (``container_builder``),
PostgreSQL and brokers, with real worker processes of this service. What each proves is in
``outbox_kit.testing.reliability`` and ``outbox_kit.testing.protocol_model``;
``make test-mutations`` checks that they catch the bugs they exist for."""

from outbox_kit.testing.protocol_model import *  # noqa: F403 (the model's test)
from outbox_kit.testing.reliability import *  # noqa: F403 (the scenarios, their fixtures and marks)
