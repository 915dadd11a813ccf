"""What a consumer refuses before its handler runs: a message older than the inbox remembers
(``stale``), a body that is not a readable JSON object, an event no class answers to, or an event
the consumer does not take. Each refusal is a ``RejectedMessageError`` with its reason tag: the
transport dead-letters the message at once and never retries it."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any, cast

from ..application.handler_types import Consumer
from ..application.registry import MalformedPayloadError, MessageRegistry, UnknownMessageError
from ..domain.events import Message
from ..messaging.envelope import Envelope
from ..messaging.rejections import RejectedMessageError, Rejection


def refuse_stale(envelope: Envelope, now: datetime, max_age: timedelta | None) -> None:
    """Reject a message older than the inbox remembers (see the module docstring)."""
    if max_age is None:
        return
    age = now - envelope.occurred_on
    if age > max_age:
        detail = (
            f"x-occurred-on {envelope.occurred_on.isoformat()} is {age.days} days old, older than "
            f"INBOX__RETENTION_DAYS ({max_age.days}): a duplicate could no longer be recognised"
        )
        raise RejectedMessageError(Rejection.STALE, detail)


def decode(registry: MessageRegistry, consumer: Consumer[Any], event_name: str, body: bytes) -> Message:
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError) as error:  # not JSON, not UTF-8, an int past
        # Python's digit limit (ValueError), or nesting deeper than the recursion limit
        detail = f"the body is not readable JSON: {type(error).__name__}: {error}"
        raise RejectedMessageError(Rejection.MALFORMED_BODY, detail) from error
    if not isinstance(payload, dict):
        raise RejectedMessageError(Rejection.MALFORMED_BODY, "the body is not a JSON object")
    try:
        message = registry.load(event_name, payload)
    except UnknownMessageError as error:
        raise RejectedMessageError(Rejection.UNKNOWN_EVENT, str(error)) from error
    except MalformedPayloadError as error:
        raise RejectedMessageError(Rejection.MALFORMED_BODY, str(error)) from error
    if not isinstance(message, consumer.event_type):
        detail = f"{event_name} is not consumed by {consumer.name}"
        raise RejectedMessageError(Rejection.UNEXPECTED_EVENT, detail)
    return cast("Message", message)
