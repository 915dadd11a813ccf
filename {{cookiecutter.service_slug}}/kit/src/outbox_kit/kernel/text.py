"""Text from outside (an exception's message, a broker header, a request) made safe to keep.

PostgreSQL refuses NUL in text, and no driver encodes a lone surrogate (how Python keeps bytes
it could not decode): stored as it came, such a text makes the very write that records a failure
fail, and a row whose failure cannot be recorded is retried uncharged forever. Everything the
service writes from an exception or a message goes through :func:`storable` first.

Text a *caller* sends is not cleaned but refused where it enters (:func:`is_storable`, at the
HTTP edge), so SQLite, which would keep it, and PostgreSQL give one answer, and what is stored is
what the caller sent. Identities (tenant, user, roles) are stricter: no control character at all
(:func:`is_plain_identifier`), since they are copied into headers, log lines and every table.
Refusals echo at most a short prefix of what they refused (:func:`shorten`).

Text written where a line or a byte means something (log lines, the header values of dead-letter
copies) is escaped instead (:func:`escape_controls`, :func:`safe_text`): control characters (C0
with CR, LF and NUL; DEL; C1 with NEL; the Unicode line and paragraph separators) and lone
surrogates become a visible ``\\n``, ``\\xNN`` or ``\\uNNNN``, and everything else, any other
language's letters included, stays as it is: one value stays one line of valid text.
"""

from __future__ import annotations

import re

from .escaping import ELLIPSIS, bounded

REPLACEMENT = "\N{REPLACEMENT CHARACTER}"
# NUL and every surrogate code point: what a UTF-8 text column cannot hold.
_UNSTORABLE = {0: REPLACEMENT} | dict.fromkeys(range(0xD800, 0xE000), REPLACEMENT)
_UNSTORABLE_CLASS = "\x00\ud800-\udfff"  # the same code points, as a pattern's character class
_HAS_UNSTORABLE = re.compile(f"[{_UNSTORABLE_CLASS}]")
_HAS_CONTROL_OR_UNSTORABLE = re.compile(f"[\x01-\x1f\x7f-\x9f{_UNSTORABLE_CLASS}]")
ECHO_LIMIT = 64


def storable(text: str, limit: int) -> str:
    """Valid UTF-8 without NUL, at most ``limit`` characters; what could not be kept becomes
    U+FFFD, so a reader still sees that something was there."""
    return text[:limit].translate(_UNSTORABLE)


def describe(error: BaseException) -> str:
    """``Type: message``, even for an exception whose ``__str__`` raises."""
    try:
        message = str(error)
    except Exception:  # noqa: BLE001 (a hostile or broken __str__ must not stop the caller)
        return f"{type(error).__name__} (its message could not be read)"
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def is_storable(text: str) -> bool:
    """False for text with NUL or a surrogate code point (an unpaired surrogate)."""
    return _HAS_UNSTORABLE.search(text) is None


def is_plain_identifier(text: str) -> bool:
    """False for text with a control character (C0, DEL, C1) or a surrogate code point."""
    return _HAS_CONTROL_OR_UNSTORABLE.search(text) is None


def shorten(text: str, limit: int = ECHO_LIMIT) -> str:
    """The first ``limit`` characters of ``text``, marked with ``...`` when cut (for echoes)."""
    return bounded(text, limit + len(ELLIPSIS))
