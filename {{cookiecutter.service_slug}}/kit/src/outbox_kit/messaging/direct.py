"""Publishing integration events without the outbox (in-process transport, outbox off).

A single-process host with the outbox off hands integration events straight to the bus right
after its commit: best effort, with no row to retry from. Brokers never run this way: a broker
transport with the outbox explicitly off is refused at start-up.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable

from ..application.messages import IntegrationEvent
from ..application.registry import MessageRegistry
from ..domain.events import utc_now
from ..kernel.hops import capture
from .bus import MessageBus
from .envelope import Envelope


class DirectPublisher:
    """Turns an integration event into an envelope under the ambient context and publishes it."""

    def __init__(self, bus: Callable[[], MessageBus], registry: MessageRegistry) -> None:
        self._bus = bus  # resolved on use: the bus is built after the unit-of-work machinery
        self._registry = registry

    async def __call__(self, event: IntegrationEvent) -> None:
        envelope = Envelope(
            message_id=str(uuid.uuid4()),
            event_name=event.message_name,
            occurred_on=getattr(event, "occurred_on", None) or utc_now(),
            body=json.dumps(self._registry.dump(event), separators=(",", ":")).encode(),
            context=capture(),
            ordering_key=event.ordering_key(),
        )
        await self._bus().publish(envelope)
