"""Text that is safe to store, log and echo: storable text, escaped controls, masked credentials.

**Text from outside** (an exception's message, a broker header, a request) made safe to keep.
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

**Credentials never leave the process inside a URL.** Every URL the service logs or shows (the
development banner, readiness errors, any log line, a library's included) has its password
masked by :func:`mask_credentials`: ``postgresql://app:***@db/app``. The user name stays (it
says which account failed); a URL without a password is unchanged.
:class:`CredentialMaskingFilter` applies it to every record a handler writes, message and
traceback; ``outbox_kit.runtime.cli.configure_logging`` puts it on the process's one handler."""

from __future__ import annotations

import json
import logging
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


# scheme://user:password@ -- the password runs to the last '@' before the host, so a password
# with an unencoded '@' or ':' is masked whole.
_URL_CREDENTIALS = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s/?#@:]*):[^\s/?#]*@")


def mask_credentials(text: str) -> str:
    """``text`` with the password of every ``scheme://user:password@host`` URL replaced by ``***``."""
    return _URL_CREDENTIALS.sub(r"\g<head>:***@", text)


class CredentialMaskingFilter(logging.Filter):
    """Masks URL passwords in what a handler writes: the message and the formatted traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = mask_credentials(message)
        if masked != message:
            record.msg, record.args = masked, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = mask_credentials(record.exc_text)
        return True


def short_echo(value: object) -> object:
    """``value`` itself when its JSON form is short, else the start of that JSON form."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return value if len(text) <= ECHO_LIMIT else shorten(text)
