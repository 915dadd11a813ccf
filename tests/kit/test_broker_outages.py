"""Which publish errors mean "the broker is unreachable" (the row is paused, not charged)."""

from __future__ import annotations

import pytest
from aiormq.exceptions import AMQPConnectionError, ChannelInvalidStateError
from outbox_kit.application.messages import MessageRegistry
from outbox_kit.transports.envelope import Signer
from outbox_kit.transports.rabbit import RabbitTransport
from outbox_kit.transports.settings import EndpointNames, MessageBusSettings

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("error", "outage"),
    [
        (AMQPConnectionError("connection refused"), True),
        (ChannelInvalidStateError("channel closed"), True),
        (Exception(), True),  # aiormq's reject_all(None): the connection closed under the publish
        (Exception("a handler's own failure"), False),
        (ValueError(), False),
        (RuntimeError("unroutable"), False),
    ],
)
def test_rabbitmq_outages_include_the_bare_exception_of_a_closed_connection(
    error: BaseException, outage: bool
) -> None:
    settings = MessageBusSettings(transport="rabbitmq", url="amqp://guest:guest@127.0.0.1:5672/")
    transport = RabbitTransport(
        settings, EndpointNames("outages-test"), MessageRegistry(), Signer({}, None, allow_unsigned=True)
    )
    assert transport.is_outage(error) is outage
