"""Text from outside (an exception's message, a broker header) made safe to store.

PostgreSQL refuses NUL in text, and no driver encodes a lone surrogate (how Python keeps bytes
it could not decode): stored as it came, such a text makes the very write that records a failure
fail, and a row whose failure cannot be recorded is retried uncharged forever. Everything the
service writes from an exception or a message goes through :func:`storable` first.
"""

from __future__ import annotations

REPLACEMENT = "\N{REPLACEMENT CHARACTER}"
# NUL and every surrogate code point: what a UTF-8 text column cannot hold.
_UNSTORABLE = {0: REPLACEMENT} | dict.fromkeys(range(0xD800, 0xE000), REPLACEMENT)


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
