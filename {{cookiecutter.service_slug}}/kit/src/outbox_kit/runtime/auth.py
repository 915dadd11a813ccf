"""Bearer tokens: HS256 JWTs carrying ``sub`` (user), ``tenant`` and ``roles``.

Minting exists for development and tests (``python -m <package> token``); production services
usually receive tokens from an identity provider that shares the secret or key."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import jwt

from outbox_kit.application.context import (
    MAX_ROLES_BYTES,
    MAX_TENANT_BYTES,
    MAX_USER_BYTES,
    fits,
    flattened_size,
    utf8_size,
)
from outbox_kit.application.text import is_plain_identifier
from outbox_kit.application.timing import Clock

# Far above any token this service mints (three short claims); a longer one is refused before
# it is decoded, so an oversized header costs no base64 and JSON work.
MAX_TOKEN_LENGTH = 8192
# The registered times, in seconds since the epoch. PyJWT reads them with int(), so a string, a
# float and 1e308 (a token that never expires) passed; a time is an integer up to 9999-12-31.
TIME_CLAIMS = ("exp", "nbf", "iat")
LATEST_TIME = 253_402_300_799


class InvalidTokenError(ValueError):
    """The bearer token is missing a claim, expired, or not signed with our secret."""


@dataclass(frozen=True, slots=True)
class Identity:
    """What a verified token says about the caller."""

    user_id: str
    tenant_id: str
    roles: tuple[str, ...]


class TokenService:
    """Mint and verify tokens with one shared secret."""

    def __init__(
        self,
        *,
        secret: str,
        algorithm: str = "HS256",
        issuer: str = "",
        audience: str = "",
        ttl: timedelta = timedelta(hours=1),
        clock: Clock,
    ) -> None:
        self._secret = secret
        self._algorithm = algorithm
        self._issuer = issuer
        self._audience = audience
        self._ttl = ttl
        self._clock = clock

    def mint(self, *, user_id: str, tenant_id: str, roles: tuple[str, ...] = ()) -> str:
        now: datetime = self._clock()
        claims: dict[str, Any] = {
            "sub": user_id,
            "tenant": tenant_id,
            "roles": list(roles),
            "iat": now,
            "exp": now + self._ttl,
        }
        if self._issuer:
            claims["iss"] = self._issuer
        if self._audience:
            claims["aud"] = self._audience
        return jwt.encode(claims, self._secret, algorithm=self._algorithm)

    def verify(self, token: str) -> Identity:
        if len(token) > MAX_TOKEN_LENGTH:
            msg = f"invalid bearer token: longer than {MAX_TOKEN_LENGTH} characters"
            raise InvalidTokenError(msg)
        try:
            claims = jwt.decode(
                token,
                self._secret,
                algorithms=[self._algorithm],
                issuer=self._issuer or None,
                audience=self._audience or None,
                options={"require": ["sub", "exp"]},
            )
        except jwt.PyJWTError as error:
            msg = f"invalid bearer token: {error}"
            raise InvalidTokenError(msg) from error
        return self._identity(claims)

    @staticmethod
    def _identity(claims: dict[str, Any]) -> Identity:
        _refuse_odd_times(claims)
        user, tenant, roles = claims.get("sub"), claims.get("tenant"), claims.get("roles", [])
        # Bytes in UTF-8, the unit consumers bound the signed headers in: a value that fit in
        # characters but not in bytes was accepted here and refused by every consumer.
        user = _bounded_text("sub", user, MAX_USER_BYTES)
        tenant = _bounded_text("tenant", tenant, MAX_TENANT_BYTES)
        if isinstance(roles, str):
            roles = [r for r in roles.split(",") if r]
        if not isinstance(roles, list) or not all(isinstance(r, str) for r in roles):
            msg = "invalid bearer token: 'roles' must be a list of strings"
            raise InvalidTokenError(msg)
        if flattened_size(roles) > MAX_ROLES_BYTES:
            msg = (
                f"invalid bearer token: 'roles' must be at most {MAX_ROLES_BYTES} bytes in UTF-8 "
                f"comma-joined, got {flattened_size(roles)}"
            )
            raise InvalidTokenError(msg)
        _refuse_control_characters(sub=[user], tenant=[tenant], roles=roles)
        return Identity(user_id=user, tenant_id=tenant, roles=tuple(roles))


def _bounded_text(claim: str, value: object, limit: int) -> str:
    if isinstance(value, str) and fits(value, limit):
        return value
    got = f", got {utf8_size(value)}" if isinstance(value, str) else ""
    msg = f"invalid bearer token: '{claim}' must be a string of 1-{limit} bytes in UTF-8{got}"
    raise InvalidTokenError(msg)


def _refuse_odd_times(claims: dict[str, Any]) -> None:
    for claim in TIME_CLAIMS:
        value = claims.get(claim)
        if value is None:
            continue
        if type(value) is not int or not 0 <= value <= LATEST_TIME:
            msg = f"invalid bearer token: '{claim}' must be an integer number of seconds up to {LATEST_TIME}"
            raise InvalidTokenError(msg)


def _refuse_control_characters(**claims: list[str]) -> None:
    """The identity is copied into every row, header and log line the request causes: a CRLF
    or NUL there would forge lines or break storage, so the whole token is refused."""
    for claim, values in claims.items():
        if not all(is_plain_identifier(value) for value in values):
            msg = f"invalid bearer token: '{claim}' must not contain control characters"
            raise InvalidTokenError(msg)
