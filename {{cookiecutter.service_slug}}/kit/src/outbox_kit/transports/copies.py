"""Dead-letter copies (and Kafka's retry copy), fitted to what the broker accepts.

They are sized against what the transport accepts before
they are published. A copy carries the original's headers escaped (a control byte becomes
``\\xNN``, four times its size), so an original the broker accepted can give a copy it refuses,
and how it refuses depends on the transport: RabbitMQ closes the whole connection on a header
frame over ``frame_max`` (every consumer and publisher on it included, and the message comes back
after the reconnect), NATS closes the connection on a message over ``max_payload`` and refuses
headers over 64 KiB, Kafka's producer refuses a record over ``max_request_size``. So every copy is
measured first (:class:`CopyLimit`, one per transport): a copy that does not fit keeps only its
essential headers (the service's signed headers within their own limits, and the reason), and a
body that still does not fit is cut; a copy the broker refuses all the same is sent again as a
minimal copy (essential headers, no body). What was left out is said in ``x-truncated``. A
refusal is then a failure of that one message, never of the connection, and every message still
ends processed or dead-lettered.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from outbox_kit.application.text import as_str, safe_text
from outbox_kit.transports.envelope import (
    LIMITS,
    SIGNATURE,
    SIGNED_HEADERS,
)
from outbox_kit.transports.received import ERROR_LIMIT, HEADER_VALUE_LIMIT, TRUNCATED, own_headers

log = logging.getLogger(__name__)


HeaderSize = Callable[[Mapping[str, str]], int]
Publish = Callable[[bytes, dict[str, str]], Awaitable[None]]


def utf8_size(headers: Mapping[str, str]) -> int:
    """Names and values in UTF-8, with a few bytes of framing each (Kafka's varints, Redis's
    lengths): what a header block weighs where the transport has no fixed layout."""
    return sum(len(name.encode()) + len(value.encode()) + 8 for name, value in headers.items())


@dataclass(frozen=True)
class CopyLimit:
    """What one copy may weigh on a transport, as that transport measures it (None: no limit
    that a copy of an accepted message can reach). Each bound already leaves room for what
    FastStream and the client add to a publish (a content type, a correlation id, framing)."""

    header_bytes: int | None
    message_bytes: int | None
    header_size: HeaderSize = utf8_size

    def headers_fit(self, headers: Mapping[str, str]) -> bool:
        return self.header_bytes is None or self.header_size(headers) <= self.header_bytes

    def body_room(self, headers: Mapping[str, str]) -> int | None:
        """How many body bytes fit next to ``headers`` (None: any)."""
        return None if self.message_bytes is None else max(self.message_bytes - self.header_size(headers), 0)

    def fits(self, body: bytes, headers: Mapping[str, str]) -> bool:
        room = self.body_room(headers)
        return self.headers_fit(headers) and (room is None or len(body) <= room)


NO_LIMIT = CopyLimit(header_bytes=None, message_bytes=None)


def signed_essentials(headers: Mapping[str, str]) -> dict[str, str]:
    """The service's signed headers (and the signature) of a copy, each only when within its own
    limit: what identifies the message and lets a replayed copy verify."""
    return {
        name: headers[name]
        for name in (*SIGNED_HEADERS, SIGNATURE)
        if name in headers and len(headers[name].encode()) <= LIMITS[name]
    }


def _with_note(headers: Mapping[str, str], note: str) -> dict[str, str]:
    earlier = headers.get(TRUNCATED)
    return {**headers, TRUNCATED: f"{earlier}; {note}" if earlier else note}


def fitted(
    body: bytes, headers: dict[str, str], essentials: dict[str, str], limit: CopyLimit
) -> tuple[bytes, dict[str, str]]:
    """The copy as it will fit ``limit``: whole when it does; else with ``essentials`` only as its
    headers, and the body cut to the room left. ``x-truncated`` says what was left out."""
    if limit.fits(body, headers):
        return body, headers
    if not limit.headers_fit(headers):
        dropped = len(headers) - len(essentials)
        headers = _with_note(essentials, f"headers: {dropped} left out, over the transport's header limit")
    room = limit.body_room(headers)
    if room is not None and len(body) > room:
        headers = _with_note(headers, f"body: first {max(room - 128, 0)} of {len(body)} bytes")
        body = body[: max(room - 128, 0)]  # 128: the note itself
    return body, headers


async def publish_copy(
    publish: Publish,
    body: bytes,
    headers: dict[str, str],
    *,
    essentials: dict[str, str],
    limit: CopyLimit,
    refusals: tuple[type[BaseException], ...],
) -> None:
    """Publish the copy fitted to ``limit``; when the broker refuses it all the same (one of
    ``refusals``: a size or content refusal of this message, never an outage), publish the
    minimal copy instead: ``essentials``, no body, the refusal in ``x-truncated``."""
    body, headers = fitted(body, headers, essentials, limit)
    try:
        await publish(body, headers)
    except refusals as refused:
        reason = safe_text(f"{type(refused).__name__}: {refused}", 300)
        log.warning("copy of message refused (%s); publishing a minimal copy", reason)
        note = f"refused whole ({reason}): headers and body ({len(body)} bytes) left out"
        minimal = _with_note(essentials, note)
        await publish(b"", minimal)


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


@dataclass(frozen=True)
class DeadLetterCopy:
    """A message found in a consumer's dead-letter destination."""

    headers: dict[str, str]
    body: bytes

    @property
    def error(self) -> str:
        return self.headers.get("x-error", "")
