"""Signing the context headers: HMAC-SHA256 over a canonical encoding of the signed headers and the
body, with keys that rotate (every listed key id verifies, the active one signs)."""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping

from .header_names import SIGNATURE, SIGNED_HEADERS
from .rejections import RejectedMessageError, Rejection


def _canonical(headers: Mapping[str, str], body: bytes) -> bytes:
    signed = [[name, headers.get(name, "")] for name in SIGNED_HEADERS]
    return json.dumps(signed, separators=(",", ":")).encode() + b"\n" + body


class Signer:
    """Signs outgoing and verifies incoming headers with a rotating set of HMAC keys."""

    def __init__(self, keys: Mapping[str, str], active_key_id: str | None, *, allow_unsigned: bool) -> None:
        self._keys = {kid: secret.encode() for kid, secret in keys.items()}
        self._active = active_key_id
        self.allow_unsigned = allow_unsigned

    @property
    def signs(self) -> bool:
        return self._active is not None

    def sign(self, headers: dict[str, str], body: bytes) -> dict[str, str]:
        if self._active is None:
            return headers
        digest = hmac.new(self._keys[self._active], _canonical(headers, body), hashlib.sha256)
        return headers | {SIGNATURE: f"{self._active}:{digest.hexdigest()}"}

    def verify(self, headers: Mapping[str, str], body: bytes) -> None:
        signature = headers.get(SIGNATURE)
        if not signature:
            if self._keys and not self.allow_unsigned:
                raise RejectedMessageError(Rejection.UNSIGNED, "the message has no x-context-signature")
            return
        kid, sep, hex_digest = signature.partition(":")
        key = self._keys.get(kid)
        if not sep or key is None:
            raise RejectedMessageError(Rejection.BAD_SIGNATURE, f"unknown signing key id {kid!r}")
        expected = hmac.new(key, _canonical(headers, body), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(expected, hex_digest):
            raise RejectedMessageError(Rejection.BAD_SIGNATURE, "the signature does not match")
