"""What every broker transport provides to the FastStream bus.

Everything that arrives is untrusted, bytes and headers alike, and every message must end
acknowledged: processed, retried (bounded) or dead-lettered with a reason. So the transports:

* hand the body over undecoded (:func:`undecoded_body` replaces FastStream's decoder, which would
  run ``json.loads`` before the service sees the message: a 5,000-digit integer or a deeply
  nested array raised there, outside any error handling, and the message stayed unacknowledged);
  the consume pipeline decodes it, where a bad body is a rejection;
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
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ...application.handlers import Consumer
from ...kernel.text import as_str, safe_text
from ...messaging.envelope import LIMITS, MESSAGE_ID, Envelope, RejectedMessageError, Rejection

OWN_HEADER_PREFIXES = ("x-", "traceparent")
BROKER_COUNTERS = ("x-death", "x-delivery-count")
# Far above any legitimate header (the largest, x-user-roles, is limited to 512 bytes on read),
# so a copy of a genuine message keeps its signed headers intact and stays replayable.
HEADER_VALUE_LIMIT = 1024
HEADER_NAME_LIMIT = 200
ERROR_LIMIT = 1000
_COUNT = re.compile(r"[0-9]{1,18}")
log = logging.getLogger(__name__)
RawParser = Callable[[Any], Awaitable[Any]]


class Delivery(Protocol):
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


DeliveryHandler = Callable[[Delivery], Awaitable[None]]


@dataclass(frozen=True)
class DeadLetterCopy:
    """A message found in a consumer's dead-letter destination."""

    headers: dict[str, str]
    body: bytes

    @property
    def error(self) -> str:
        return self.headers.get("x-error", "")


class BrokerTransport(Protocol):
    """Topology, publish and subscribe for one broker."""

    broker: Any

    def subscribe(self, consumer: Consumer[Any], handler: DeliveryHandler) -> None: ...

    async def connect(self) -> None: ...

    async def declare(self, consumers: Sequence[Consumer[Any]]) -> None: ...

    async def start_consuming(self) -> None: ...

    async def close(self) -> None: ...

    async def ping(self) -> None: ...

    async def publish(self, envelope: Envelope, headers: dict[str, str]) -> None: ...

    async def dead_letters(self, consumer: Consumer[Any], limit: int = 100) -> list[DeadLetterCopy]:
        """Read a consumer's dead letters (RabbitMQ consumes them; the others only read)."""
        ...

    def is_outage(self, error: BaseException) -> bool:
        """True when ``error`` means the broker is unreachable (not that the message is bad)."""
        ...

    async def delete_topology(self, consumers: Sequence[Consumer[Any]]) -> None:
        """Delete what ``declare`` created, messages included (tests, decommissioning)."""
        ...


async def undecoded_body(message: Any) -> bytes:  # noqa: ANN401 (a FastStream message)
    """FastStream's decoder, replaced: the body stays the bytes that arrived (see the module)."""
    return bytes(message.body)


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
    """Our headers (x-*, traceparent) as one line of valid text each, bounded: what a
    dead-letter copy carries along (the broker's own counters stay behind)."""
    kept: dict[str, str] = {}
    for name, value in headers.items():
        if name.startswith(OWN_HEADER_PREFIXES) and name not in BROKER_COUNTERS:
            kept[safe_text(name, HEADER_NAME_LIMIT)] = safe_text(value, HEADER_VALUE_LIMIT)
    return kept


def dead_letter_headers(
    headers: Mapping[str, object], error: str, attempt: int, origin: str
) -> dict[str, str]:
    return own_headers(headers) | {
        "x-error": safe_text(error, ERROR_LIMIT),
        "x-attempts": str(attempt),
        "x-original-address": origin,
    }


def as_text(headers: Mapping[str, object]) -> dict[str, str]:
    """Headers read back from a dead-letter destination, as text (never raising on bytes)."""
    return {k: as_str(v) for k, v in headers.items()}


def message_id_of(headers: Mapping[str, object]) -> str:
    """The message id for logs and broker properties: one line, within the id's own limit."""
    return safe_text(headers.get(MESSAGE_ID, "?"), LIMITS[MESSAGE_ID])


class PingFailedError(ConnectionError):
    """The broker did not answer."""


class ReceivedMessage:
    """What every transport's delivery shares: headers, body, message id and the ack."""

    def __init__(self, message: Any, headers: Mapping[str, object] | None = None) -> None:  # noqa: ANN401 (a FastStream message)
        self._message = message
        self.headers: dict[str, object] = dict(message.headers or {}) if headers is None else dict(headers)
        self.body: bytes = message.body

    @property
    def message_id(self) -> str:
        return message_id_of(self.headers)

    async def ack(self) -> None:
        await self._message.ack()

    @property
    def heartbeat_seconds(self) -> float | None:
        return None  # RabbitMQ and Kafka do not redeliver to a live consumer

    async def touch(self) -> None:
        return None


class FastStreamTransport:
    """The broker lifecycle every transport shares (the broker itself is set by the subclass)."""

    broker: Any
    label = "the broker"

    async def connect(self) -> None:
        await self.broker.connect()

    async def start_consuming(self) -> None:
        await self.broker.start()

    async def close(self) -> None:
        await self.broker.stop()

    async def ping(self) -> None:
        if not await self.broker.ping(timeout=2.0):
            msg = f"{self.label} did not answer"
            raise PingFailedError(msg)
