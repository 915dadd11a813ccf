"""Rules for text that comes from outside: what is refused, and how much of it is echoed.

*Unstorable* characters are the ones no database stores the same way: PostgreSQL refuses NUL in
``text`` and ``jsonb`` and cannot encode an unpaired UTF-16 surrogate, while SQLite keeps NUL (and
fails on the surrogate only while encoding). Such text is refused where it enters, so every
database gives the same answer; it is never cleaned, because a cleaned value is not what the
caller sent. Identities (tenant, user, roles) are stricter: no control character at all, since
they end up in headers, log lines and every table.
"""

from __future__ import annotations

import re

ECHO_LIMIT = 64
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
_CONTROL_OR_UNSTORABLE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def is_storable(text: str) -> bool:
    """False for text with NUL or an unpaired surrogate."""
    return _UNSTORABLE.search(text) is None


def is_plain_identifier(text: str) -> bool:
    """False for text with a control character (C0, DEL, C1) or an unpaired surrogate."""
    return _CONTROL_OR_UNSTORABLE.search(text) is None


def shorten(text: str, limit: int = ECHO_LIMIT) -> str:
    """At most ``limit`` characters of ``text``, marked with ``...`` when cut (for echoes)."""
    return text if len(text) <= limit else f"{text[:limit]}..."
