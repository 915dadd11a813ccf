"""A consumed message's log lines carry its correlation id and tenant (the context its headers
carry), from its ``Received`` to its ``Processed``, never the worker's own: the worker's logs can
be followed from the API's. Every broker transport."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from outbox_kit.application.context import current_context
from outbox_kit.application.logs import ContextFilter
from outbox_kit.testing.fixtures import acting_as
from test_brokers import TRANSPORTS, Start, effects_become, publish_through_outbox
from test_brokers import start as start  # the fixture  # noqa: PLC0414

pytestmark = pytest.mark.integration
CORRELATION, TENANT = "c-follow-me", "globex"


class Collecting(logging.Handler):
    """What the service's log handler would write: records with the context filter's fields."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.addFilter(ContextFilter())
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def collected() -> Iterator[Collecting]:
    handler, logger = Collecting(), logging.getLogger("outbox_kit")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def consumer_lines(records: list[logging.LogRecord]) -> list[logging.LogRecord]:
    """The lines a consumer writes about a message: FastStream's and the consume path's."""
    return [r for r in records if r.name.startswith(("outbox_kit.transports", "outbox_kit.consume"))]


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_consumed_messages_lines_carry_its_correlation_and_tenant(
    start: Start, transport: str, collected: Collecting
) -> None:
    with acting_as():
        worker_correlation = current_context().correlation_id  # what the test task logs under
    container, _ = await start(transport)
    collected.records.clear()
    await publish_through_outbox(container, 1, tenant=TENANT, correlation_id=CORRELATION)
    await effects_become(container, ["consumed:1"], timeout=30)
    lines = consumer_lines(collected.records)
    messages = [r.getMessage() for r in lines]
    assert any("received" in m.lower() for m in messages), messages
    assert any("processed" in m.lower() for m in messages), messages
    wrong = [
        (r.name, r.getMessage(), r.correlation_id, r.tenant_id)  # type: ignore[attr-defined]
        for r in lines
        if (r.correlation_id, r.tenant_id) != (CORRELATION, TENANT)  # type: ignore[attr-defined]
    ]
    assert wrong == []
    assert all(r.correlation_id != worker_correlation for r in lines)  # type: ignore[attr-defined]
