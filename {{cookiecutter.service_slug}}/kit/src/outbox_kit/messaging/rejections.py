"""Why a message is refused without being processed: short stable reason tags for metrics and dead-
letter copies, carried by RejectedMessageError; the transport dead-letters such a message at
once and never retries it."""

from __future__ import annotations

from enum import StrEnum


class Rejection(StrEnum):
    """Why a message is dead-lettered without being processed (stable tags for metrics)."""

    UNSIGNED = "unsigned"
    BAD_SIGNATURE = "bad_signature"
    MALFORMED_HEADER = "malformed_header"
    OVERSIZED_HEADER = "oversized_header"
    MALFORMED_BODY = "malformed_body"
    UNKNOWN_EVENT = "unknown_event"
    UNEXPECTED_EVENT = "unexpected_event"
    STALE = "stale"  # older than the inbox remembers (see inbox/pipeline.py)
    # A processed message id arriving again with another signed body (see inbox/pipeline.py).
    CONFLICTING_DUPLICATE = "conflicting_duplicate"


class RejectedMessageError(ValueError):
    """The message cannot be trusted or read; ``reason`` is a short stable tag."""

    def __init__(self, reason: Rejection, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
