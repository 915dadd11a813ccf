"""JetStream topology: the streams and durable consumers a NATS transport relies on.

Declaring a stream only ever adds subjects. Services that share a namespace share its events
stream, and during a rolling deploy the old and the new version both declare it: replacing the
subject list with our own would make the other side's publishes fail until it declares again.
The update keeps the stream's other settings (limits an operator set stay) and is re-checked,
because two services can merge at the same moment. An existing durable consumer is brought to
the current ``max_deliver`` and ``ack_wait``.
"""

from __future__ import annotations

import re
from typing import Any

from nats.js.errors import BadRequestError, NotFoundError

from .nats_delivery import ACK_WAIT_SECONDS

DECLARE_ATTEMPTS = 5


def durable_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", name)


async def ensure_stream(js: Any, name: str, subjects: list[str]) -> None:  # noqa: ANN401 (nats' JetStreamContext)
    """Create the stream, or add our subjects to it; never drop anyone else's."""
    refusal: Exception | None = None
    for _ in range(DECLARE_ATTEMPTS):
        try:
            info = await js.stream_info(name)
        except NotFoundError:
            try:
                await js.add_stream(name=name, subjects=subjects)
            except BadRequestError as error:  # created meanwhile, or a subject taken elsewhere
                refusal = error
                continue
            return
        present = list(info.config.subjects or [])
        if set(subjects) <= set(present):
            return
        info.config.subjects = sorted({*present, *subjects})
        try:
            await js.update_stream(config=info.config)
        except BadRequestError as error:
            refusal = error
    msg = f"NATS stream {name} could not be given the subjects {subjects}: {refusal}"
    raise RuntimeError(msg)


async def refresh_consumer(js: Any, stream: str, durable: str, max_delivery_attempts: int) -> None:  # noqa: ANN401
    """Bring an existing durable consumer to the current settings.

    FastStream creates a missing durable consumer but leaves an existing one as it was, so a
    raised ``MAX_DELIVERY_ATTEMPTS`` would keep the old ``max_deliver``: JetStream would stop
    redelivering before the wrapper dead-letters, and the message would sit unacknowledged
    forever. ``max_deliver`` and ``ack_wait`` are editable on a live consumer."""
    try:
        info = await js.consumer_info(stream, durable)
    except NotFoundError:
        return  # created with the current settings when it starts
    wanted = {
        "max_deliver": max_delivery_attempts + 2,
        "ack_wait": float(ACK_WAIT_SECONDS),
    }
    current = {"max_deliver": info.config.max_deliver, "ack_wait": info.config.ack_wait}
    if current != wanted:
        info.config.max_deliver = wanted["max_deliver"]
        info.config.ack_wait = wanted["ack_wait"]
        await js.add_consumer(stream, config=info.config)
