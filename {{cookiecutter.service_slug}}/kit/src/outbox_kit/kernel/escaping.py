"""Text written where a line or a byte means something (log lines, the header values of dead-letter
copies) is escaped: control characters (C0 with CR, LF and NUL; DEL; C1 with NEL; the Unicode
line and paragraph separators) and lone surrogates become a visible escape, everything else (any
language's letters) stays: one value stays one line of valid text."""

from __future__ import annotations

import re

_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}

ELLIPSIS = "..."  # ASCII: FastStream 0.7.8 writes Redis header lengths in characters, not bytes


def escape_controls(text: str) -> str:
    """``text`` with every control character and lone surrogate replaced by a visible escape."""
    return _UNSAFE.sub(_escape, text)


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def as_str(value: object) -> str:
    """Any header value as text without raising: bytes that are not UTF-8 keep their bytes
    visible as ``\\xNN`` instead of failing the decode."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8", "backslashreplace")
    return value if isinstance(value, str) else str(value)


def bounded(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters, marked with an ellipsis when cut."""
    return text if len(text) <= limit else text[: limit - len(ELLIPSIS)] + ELLIPSIS


def safe_text(value: object, limit: int) -> str:
    """An untrusted value as one line of valid text of at most ``limit`` characters."""
    return bounded(escape_controls(as_str(value)), limit)
