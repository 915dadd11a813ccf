"""Schemathesis hooks for the contract test (loaded by path through ``SCHEMATHESIS_HOOKS``).

Every request gets an ``Idempotency-Key`` of its own. Schemathesis draws header values from the
schema, so two generated requests often share a key (``"0"``) with different bodies, and the
service rightly answers the second with 422 ``idempotency_key_reused``: the document says so,
but a schema cannot say which earlier request a key belongs to, so the check that schema-valid
requests are accepted would fail on it. Reusing a key is proven by the generated service's own
idempotency tests; here every request is a new one, as a client's first attempt is.
"""

from __future__ import annotations

import uuid
from typing import Any

import schemathesis

IDEMPOTENCY_KEY = "Idempotency-Key"


@schemathesis.hook
def before_call(ctx: Any, case: Any, **kwargs: Any) -> None:
    """A fresh key wherever the generated request carries one (schemathesis may send none)."""
    headers = case.headers or {}
    for name in list(headers):
        if name.lower() == IDEMPOTENCY_KEY.lower():
            headers[name] = str(uuid.uuid4())
