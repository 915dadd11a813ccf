"""What a broker transport receives, read without trusting it, and the :class:`BrokerDelivery` it
hands the consume wrapper.

Everything that arrives is untrusted, bytes and headers alike, and every message must
end acknowledged: processed, retried (bounded) or dead-lettered with a reason. So the transports:

* hand the message over undecoded (:func:`the_message` replaces FastStream's decoder, which would
  run ``json.loads`` before the service sees the message: a 5,000-digit integer or a deeply
  nested array raised there, outside any error handling, and the message stayed unacknowledged);
  the consume pipeline decodes the body, where a bad body is a rejection. The brokers run
  without FastStream's dependency injection (``apply_types=False``): the subscriber is called with
  what the decoder returned, the message itself (resolving a ``Context`` argument ran in a thread
  pool per message: a sixth of a consumed message's CPU);
* read the broker's delivery counters strictly (:func:`broker_count`): a counter the broker
  would never write was forged or mangled on the way, and with it the retries can no longer be
  bounded, so the message is rejected (``malformed_header``) instead of trusted or crashed on;
* copy header values onto dead-letter copies only as one line of valid UTF-8 text, bounded
  (:func:`own_headers`): a value that is not UTF-8 used to crash the copy itself;
* where FastStream's own parser fails on what a broker can carry (Redis, Kafka), parse a
  readable stand-in instead (:func:`fallback_parser`), so the handler runs and ends the message.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from outbox_kit.application.text import as_str, safe_text
from outbox_kit.transports.envelope import (
    LIMITS,
    MESSAGE_ID,
    SIGNATURE,
    SIGNED_HEADERS,
    RejectedMessageError,
    Rejection,
)

log = logging.getLogger(__name__)
TRUNCATED = "x-truncated"

OWN_HEADER_PREFIXES = ("x-", "traceparent")

BROKER_COUNTERS = ("x-death", "x-delivery-count")

# Far above any legitimate header (the largest, x-user-roles, is limited to 512 bytes on read),
# so a copy of a genuine message keeps its signed headers intact and stays replayable.
HEADER_VALUE_LIMIT = 1024

HEADER_NAME_LIMIT = 200

ERROR_LIMIT = 1000

# The headers a copy carries beyond the service's own signed ones ("foreign": anyone's x-*), at
# most this many and this many bytes together: a copy must stay far inside every transport's
# limit (RabbitMQ's 128 KiB header frame, JetStream's 64 KiB of headers, Kafka's 1 MiB record),
# however many headers the original came with.
FOREIGN_HEADER_COUNT = 32
FOREIGN_HEADER_BYTES = 8 * 1024

# The headers a dead-letter copy writes itself: an original's own are not copied (forged ones
# would read as the service's).
REASON_HEADERS = ("x-error", "x-attempts", "x-original-address", TRUNCATED)

_COUNT = re.compile(r"[0-9]{1,18}")

RawParser = Callable[[Any], Awaitable[Any]]


async def the_message(message: Any) -> Any:  # noqa: ANN401 (a FastStream message)
    """FastStream's decoder, replaced: the subscriber gets the message itself, its body the bytes
    that arrived (see the module)."""
    return message


def fallback_parser(readable: Callable[[Any], Awaitable[Any]]) -> Callable[[Any, RawParser], Awaitable[Any]]:
    """A FastStream parser (``parser=`` of a subscriber) that runs FastStream's own and, when that
    fails on a raw message, runs it again on ``readable(raw)``: the same message made readable
    (for example without the headers it could not decode). A parser failure happens before the
    handler, so nothing would acknowledge the message: it would stay pending for good."""

    async def parse(raw: Any, original: RawParser) -> Any:  # noqa: ANN401 (a broker's raw message)
        try:
            return await original(raw)
        except Exception as error:  # noqa: BLE001 (any parser failure: read the stand-in)
            log.warning(
                "unreadable broker message, read without what failed: %s: %s", type(error).__name__, error
            )
        return await original(await readable(raw))

    return parse


def broker_count(name: str, value: object) -> int:
    """A delivery counter as the broker (or this service, for Kafka) writes it: a non-negative
    integer, or its decimal digits. Anything else raises a ``malformed_header`` rejection."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, (str, bytes)) and _COUNT.fullmatch(as_str(value)):
        return int(as_str(value))
    detail = f"{name} is not a delivery count: {safe_text(value, 80)}"
    raise RejectedMessageError(Rejection.MALFORMED_HEADER, detail)


def own_headers(headers: Mapping[str, object]) -> dict[str, str]:
    """The headers a copy carries along, each one line of valid text, bounded: the service's
    signed headers first, then other ``x-*`` headers and ``traceparent`` (the broker's counters
    stay behind) up to :data:`FOREIGN_HEADER_COUNT` and :data:`FOREIGN_HEADER_BYTES`; how many were
    left out is said in ``x-truncated``."""
    signed = {
        name: safe_text(headers[name], HEADER_VALUE_LIMIT)
        for name in (*SIGNED_HEADERS, SIGNATURE)
        if name in headers
    }
    foreign: dict[str, str] = {}
    size = left_out = 0
    for name, value in headers.items():
        if not name.startswith(OWN_HEADER_PREFIXES) or name in BROKER_COUNTERS or name in signed:
            continue
        if name in REASON_HEADERS:
            continue
        text_name, text = safe_text(name, HEADER_NAME_LIMIT), safe_text(value, HEADER_VALUE_LIMIT)
        weight = len(text_name.encode()) + len(text.encode())
        if len(foreign) >= FOREIGN_HEADER_COUNT or size + weight > FOREIGN_HEADER_BYTES:
            left_out += 1
            continue
        foreign[text_name] = text
        size += weight
    kept = signed | foreign
    if left_out:
        kept[TRUNCATED] = (
            f"headers: {left_out} left out (a copy keeps at most {FOREIGN_HEADER_COUNT} other "
            f"headers, {FOREIGN_HEADER_BYTES} bytes together)"
        )
    return kept


def message_id_of(headers: Mapping[str, object]) -> str:
    """The message id for logs and broker properties: one line, within the id's own limit."""
    return safe_text(headers.get(MESSAGE_ID, "?"), LIMITS[MESSAGE_ID])


class BrokerDelivery(Protocol):
    """One received message, with the transport's ack / retry / dead-letter steps."""

    body: bytes

    @property
    def headers(self) -> Mapping[str, object]: ...

    @property
    def message_id(self) -> str: ...

    async def attempt(self) -> int:
        """1 for the first delivery, 2 for the first redelivery, ..."""
        ...

    async def ack(self) -> None: ...

    async def retry(self, attempt: int) -> None:
        """Ask the broker to deliver the message again after a delay."""
        ...

    async def dead_letter(self, error: str, attempt: int) -> None:
        """Publish a copy to the dead-letter destination (confirmed), then ack the original."""
        ...

    @property
    def heartbeat_seconds(self) -> float | None:
        """How often ``touch`` must run while the handler works (None: never)."""
        ...

    async def touch(self) -> None:
        """Tell the broker the message is still being worked on (no redelivery meanwhile)."""
        ...


DeliveryHandler = Callable[[BrokerDelivery], Awaitable[None]]
