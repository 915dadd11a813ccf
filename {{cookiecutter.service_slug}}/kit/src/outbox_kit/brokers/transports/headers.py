"""Reading what a broker hands over without trusting it: the body undecoded, header values as text,
the broker's own delivery counters strictly, and the headers a dead-letter copy carries along
(escaped, bounded)."""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from ...kernel.escaping import as_str, safe_text
from ...messaging.header_names import LIMITS, MESSAGE_ID, SIGNATURE, SIGNED_HEADERS
from ...messaging.rejections import RejectedMessageError, Rejection
from .copies import TRUNCATED, signed_essentials

log = logging.getLogger(__name__)
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


def dead_letter_headers(
    headers: Mapping[str, object], error: str, attempt: int, origin: str
) -> tuple[dict[str, str], dict[str, str]]:
    """The headers of a dead-letter copy, and the essential ones a copy that must shrink keeps
    (the signed headers within their limits, and the reason: see copies.py)."""
    reason = reason_headers(error, attempt, origin)
    copied = own_headers(headers) | reason
    return copied, signed_essentials(copied) | reason


def reason_headers(error: str, attempt: int, origin: str) -> dict[str, str]:
    """Why and from where a message was dead-lettered: in every copy, the minimal one included."""
    return {
        "x-error": safe_text(error, ERROR_LIMIT),
        "x-attempts": str(attempt),
        "x-original-address": safe_text(origin, HEADER_VALUE_LIMIT),
    }


def as_text(headers: Mapping[str, object]) -> dict[str, str]:
    """Headers read back from a dead-letter destination, as text (never raising on bytes)."""
    return {k: as_str(v) for k, v in headers.items()}


def message_id_of(headers: Mapping[str, object]) -> str:
    """The message id for logs and broker properties: one line, within the id's own limit."""
    return safe_text(headers.get(MESSAGE_ID, "?"), LIMITS[MESSAGE_ID])
