"""What an error report may carry: every secret replaced, by value, by shape and by key.

An error-tracking event holds whatever the failing code held: the exception's message, the
variables of every frame (as the SDK's ``repr`` strings: ``HTTPAuthorizationCredentials(
credentials='eyJ...')``, a signing key as ``b'...'``), breadcrumbs, the request's headers and
body, log records. :class:`Scrubber` walks all of it before it leaves the process and replaces:

- the process's own secrets *by value*, wherever they appear inside a string (the JWT secret,
  each signing key, each URL password, any ``SecretStr`` of the settings), also in their
  ``repr``, JSON and percent-encoded spellings, and cut short where the SDK truncated the string;
- credentials *by shape*: JWT-shaped strings (``eyJ...`` base64url segments), ``Bearer``/``Basic``
  credentials, URL passwords (:func:`~outbox_kit.application.text.mask_credentials`) and
  ``name=value`` pairs whose name says secret (``token=...``, ``password: ...``);
- the value of every *key* that says secret (authorization, cookie, token, secret, password,
  key, signature, dsn...), in any mapping: headers, frame variables, extra data, contexts.

It needs no SDK type, so it serves any version of the SDK (its own scrubber moved in Sentry 3).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import quote

from outbox_kit.application.text import mask_credentials

FILTERED = "[Filtered]"  # what Sentry's own scrubber writes

# A secret shorter than this is not replaced by value (it would replace ordinary words); keys,
# shapes and URL masking still hide it.
MIN_SECRET_LENGTH = 4

# A key is secret when one of its words (split at anything not a letter or a digit) is one of
# these, or it contains one of the FRAGMENTS (``x-api-key``, ``jwt_secret``, ``set-cookie``...).
SECRET_WORDS = frozenset(
    {
        "apikey",
        "auth",
        "authorization",
        "bearer",
        "credential",
        "credentials",
        "csrf",
        "dsn",
        "jwt",
        "key",
        "keys",
        "passwd",
        "pwd",
        "session",
        "signature",
        "token",
        "tokens",
        "xsrf",
    }
)
SECRET_FRAGMENTS = ("authorization", "cookie", "password", "secret", "token")

_WORD = re.compile(r"[^a-z0-9]+")
# A JWT, whole or cut short: a base64url JSON header ("eyJ"), then its other segments.
_JWT = re.compile(r"eyJ[A-Za-z0-9_-]{8,}(?:\.[A-Za-z0-9_-]*){0,2}")
_SCHEME_CREDENTIALS = re.compile(r"(?i)\b(bearer|basic)(\s+)[A-Za-z0-9._~+/=-]+")
_SECRET_PAIR = re.compile(
    r"(?i)\b([\w-]*(?:token|secret|password|passwd|signature|authorization|credentials|api[_-]?key)[\w-]*)"
    r"""(["']?\s*[=:]\s*["']?)(?!(?:bearer|basic)\s)([^\s"'&,;)}\[\]]+)"""
)
_TRUNCATED = "..."  # how the SDK ends a string it cut short


def is_secret_key(key: str) -> bool:
    """True when a mapping key names a secret (``Authorization``, ``jwt_secret``, ``x-api-key``)."""
    lowered = key.lower()
    return any(fragment in lowered for fragment in SECRET_FRAGMENTS) or any(
        word in SECRET_WORDS for word in _WORD.split(lowered)
    )


def spellings(secret: str) -> set[str]:
    """``secret`` as it may appear inside a string: as is, in a ``repr`` of text or bytes, in
    JSON, percent-encoded."""
    forms = {
        secret,
        repr(secret)[1:-1],
        repr(secret.encode())[2:-1],
        json.dumps(secret)[1:-1],
        quote(secret, safe=""),
    }
    return {form for form in forms if len(form) >= MIN_SECRET_LENGTH}


class Scrubber:
    """Replaces secrets in any part of an error-tracking event (see the module's docstring)."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        forms = {form for secret in secrets if len(secret) >= MIN_SECRET_LENGTH for form in spellings(secret)}
        self._forms = sorted(forms, key=len, reverse=True)  # a longer spelling first: it may hold another

    def __repr__(self) -> str:
        """How many spellings, never which: the scrubber itself may be a frame variable."""
        return f"Scrubber({len(self._forms)} secret spellings)"

    def event(self, event: dict[str, Any], hint: object = None) -> dict[str, Any]:
        """``event`` with every secret replaced (``before_send`` and ``before_breadcrumb``)."""
        del hint
        scrubbed: dict[str, Any] = self.value(event)
        return scrubbed

    def value(self, value: Any) -> Any:  # noqa: ANN401 (any part of an event)
        """``value`` with every secret replaced, in every string, list and mapping it holds."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, Mapping):
            return {key: self._item(key, item) for key, item in value.items()}
        if isinstance(value, list | tuple | set | frozenset):
            return [self.value(item) for item in value]
        if value is None or isinstance(value, bool | int | float):
            return value
        # Not serialized yet (a breadcrumb's timestamp, its data): kept as it is, unless what the
        # SDK would send of it, its repr, holds a secret.
        shown = _safe_repr(value)
        scrubbed = self.text(shown)
        return value if scrubbed == shown else scrubbed

    def text(self, text: str) -> str:
        """``text`` with the process's secrets, credential shapes and URL passwords replaced."""
        for form in self._forms:
            if form in text:
                text = text.replace(form, FILTERED)
        if text.endswith(_TRUNCATED):
            text = self._cut_short(text)
        text = _JWT.sub(FILTERED, text)
        text = _SCHEME_CREDENTIALS.sub(rf"\1\2{FILTERED}", text)
        text = _SECRET_PAIR.sub(rf"\1\2{FILTERED}", text)
        return mask_credentials(text)

    def _item(self, key: object, item: Any) -> Any:  # noqa: ANN401 (any part of an event)
        if isinstance(key, str) and is_secret_key(key) and item not in (None, "", {}, []):
            return FILTERED
        return self.value(item)

    def _cut_short(self, text: str) -> str:
        """A secret the SDK's truncation cut: the part that is left ends the text."""
        head = text[: -len(_TRUNCATED)]
        for form in self._forms:
            for length in range(len(form) - 1, MIN_SECRET_LENGTH - 1, -1):
                if head.endswith(form[:length]):
                    return head[:-length] + FILTERED + _TRUNCATED
        return text


def _safe_repr(value: object) -> str:
    try:
        return repr(value)
    except Exception:  # noqa: BLE001 (any object's repr may fail; the SDK's own says so too)
        return f"<{type(value).__name__}>"
