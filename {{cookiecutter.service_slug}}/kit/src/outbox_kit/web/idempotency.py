"""The ``Idempotency-Key`` header of a create command, and its answer (see ``idempotency/keys``).

A route takes ``key: Annotated[IdempotencyKey | None, Depends(idempotency_key)]``, runs its
command through ``run_once(units, operation, key=key, request=..., status_code=201)`` and returns
``idempotent_response(answer)``: the first answer's status and exact bytes, with
``Idempotent-Replayed: true`` when it is a repeat.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Header, Request, Response

from ..idempotency.keys import Answer, IdempotencyKey

IDEMPOTENCY_KEY_HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotent-Replayed"
# Visible ASCII, as clients send UUIDs and similar tokens: no space, no control character.
KEY_PATTERN = r"^[\x21-\x7e]+$"
KEY_MAX_LENGTH = 255  # the column's size


def idempotency_key(
    request: Request,
    key: Annotated[
        str | None,
        Header(
            alias=IDEMPOTENCY_KEY_HEADER,
            min_length=1,
            max_length=KEY_MAX_LENGTH,
            pattern=KEY_PATTERN,
            description=(
                "Makes a retry safe: the same key and body (per tenant) answer the first answer"
                " without running the command again; the same key with another body answers 422."
                " Kept API__IDEMPOTENCY_KEY_RETENTION_HOURS (24 h by default)."
            ),
        ),
    ] = None,
) -> IdempotencyKey | None:
    """FastAPI dependency: the caller's key for this operation (method and path), if any."""
    if key is None:
        return None
    return IdempotencyKey(key, f"{request.method} {request.url.path}")


def idempotent_response(answer: Answer) -> Response:
    """The answer as sent the first time (same status, same bytes)."""
    headers = {REPLAYED_HEADER: "true"} if answer.replayed else None
    return Response(
        answer.body, status_code=answer.status_code, media_type="application/json", headers=headers
    )
