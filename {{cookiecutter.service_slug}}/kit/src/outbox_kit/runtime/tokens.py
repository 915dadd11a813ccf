"""Bearer tokens: HS256 JWTs carrying ``sub`` (user), ``tenant`` and ``roles``, or an identity
provider's RS256/ES256 tokens (its keys: ``runtime.identity_provider``), read and checked before
anything trusts them.

Minting exists for development and tests (``python -m <package> token``); production services
usually receive tokens from an identity provider that shares the secret or key.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

import jwt
from jwt import PyJWK

from outbox_kit.application.clock import Clock
from outbox_kit.application.context import (
    MAX_ROLES_BYTES,
    MAX_TENANT_BYTES,
    MAX_USER_BYTES,
    InvalidContextError,
    check_roles,
    fits,
    flattened_size,
    utf8_size,
)
from outbox_kit.application.text import is_plain_identifier, short_echo
from outbox_kit.runtime.identity_provider import InvalidTokenError, ProviderKeys

# Far above any token this service mints (three short claims); a longer one is refused before
# it is decoded, so an oversized header costs no base64 and JSON work.
MAX_TOKEN_LENGTH = 8192
# The registered times, in seconds since the epoch. PyJWT reads them with int(), so a string, a
# float and 1e308 (a token that never expires) passed; a time is an integer up to 9999-12-31.
TIME_CLAIMS = ("exp", "nbf", "iat")
LATEST_TIME = 253_402_300_799


class SharedSecretTokens(StrEnum):
    """Where tokens signed with ``AUTH__JWT_SECRET`` are accepted: from anyone without a provider;
    with one, from loopback callers in development (the ``token`` command keeps working on a
    laptop) and never in production."""

    ANYWHERE = "anywhere"
    LOOPBACK = "loopback"
    NEVER = "never"


@dataclass(frozen=True, slots=True)
class ClaimNames:
    """Where a token carries the user, the tenant and the roles. A name is looked up as written
    first, then as a dotted path (``realm_access.roles``), so a namespaced claim such as
    ``https://example.com/roles`` works as well."""

    user: str = "sub"
    tenant: str = "tenant"
    roles: str = "roles"


STANDARD_CLAIMS = ClaimNames()


@dataclass(frozen=True, slots=True)
class Identity:
    """What a verified token says about the caller."""

    user_id: str
    tenant_id: str
    roles: tuple[str, ...]


class TokenService:
    """Mint and verify bearer tokens.

    Shared-secret tokens (HS256 by default) are minted here for development and tests and
    verified with ``secret``; with a ``provider``, the provider's tokens are verified with the keys
    it publishes, for ``provider_algorithms`` only, against ``issuer`` and ``audience`` (both
    required then), and shared-secret tokens are accepted as ``shared_secret_tokens`` says."""

    def __init__(
        self,
        *,
        secret: str,
        algorithm: str = "HS256",
        issuer: str = "",
        audience: str = "",
        ttl: timedelta = timedelta(hours=1),
        clock: Clock,
        claims: ClaimNames = STANDARD_CLAIMS,
        provider: ProviderKeys | None = None,
        provider_algorithms: tuple[str, ...] = ("RS256",),
        shared_secret_tokens: SharedSecretTokens = SharedSecretTokens.ANYWHERE,
    ) -> None:
        if provider is not None and not (issuer and audience):
            msg = "tokens of an identity provider are checked against an issuer and an audience: set both"
            raise ValueError(msg)
        self._secret = secret
        self._algorithm = algorithm
        self._issuer = issuer
        self._audience = audience
        self._ttl = ttl
        self._clock = clock
        self._claims = claims
        self._provider = provider
        self._provider_algorithms = provider_algorithms
        self._shared = SharedSecretTokens.ANYWHERE if provider is None else shared_secret_tokens

    def mint(self, *, user_id: str, tenant_id: str, roles: tuple[str, ...] = ()) -> str:
        """A shared-secret token carrying the identity under the configured claim names."""
        now: datetime = self._clock()
        claims: dict[str, Any] = {"iat": now, "exp": now + self._ttl}
        _put_claim(claims, self._claims.user, user_id)
        _put_claim(claims, self._claims.tenant, tenant_id)
        _put_claim(claims, self._claims.roles, list(roles))
        if self._issuer:
            claims["iss"] = self._issuer
        if self._audience:
            claims["aud"] = self._audience
        return jwt.encode(claims, self._secret, algorithm=self._algorithm)

    def verify(self, token: str) -> Identity:
        """A shared-secret token's identity (wherever it comes from: the ``token`` command's check)."""
        _refuse_oversized(token)
        try:
            claims = jwt.decode(
                token,
                self._secret,
                algorithms=[self._algorithm],
                issuer=self._issuer or None,
                audience=self._audience or None,
                options={"require": ["exp"]},
            )
        except jwt.PyJWTError as error:
            msg = f"invalid bearer token: {error}"
            raise InvalidTokenError(msg) from error
        return self._identity(claims)

    async def authenticate(self, token: str, *, client_host: str | None) -> Identity:
        """The identity of a request's bearer token, ``client_host`` being who sent it."""
        if self._provider is None:
            return self.verify(token)
        _refuse_oversized(token)
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError as error:
            msg = f"invalid bearer token: {error}"
            raise InvalidTokenError(msg) from error
        algorithm, kid = header.get("alg"), header.get("kid")
        if algorithm == self._algorithm:
            if self._shared is SharedSecretTokens.LOOPBACK and client_host and is_loopback(client_host):
                return self.verify(token)
            msg = (
                f"invalid bearer token: {self._algorithm} tokens signed with AUTH__JWT_SECRET are "
                "accepted only from loopback in development; send the identity provider's token"
            )
            raise InvalidTokenError(msg)
        if algorithm not in self._provider_algorithms:
            shown = short_echo(algorithm)
            msg = f"invalid bearer token: algorithm {shown!r} is not accepted (AUTH__JWT_ALGORITHMS)"
            raise InvalidTokenError(msg)
        if not isinstance(kid, str | None):
            msg = "invalid bearer token: its 'kid' header must be a string"
            raise InvalidTokenError(msg)
        key = await self._provider.key_for(kid)
        return self._identity(self._provider_claims(token, key))

    def _provider_claims(self, token: str, key: PyJWK) -> dict[str, Any]:
        try:
            return jwt.decode(
                token,
                key,
                # The key's own algorithm only: a token cannot choose how the key is used.
                algorithms=[key.algorithm_name],
                issuer=self._issuer,
                audience=self._audience,
                options={"require": ["exp", "iss", "aud"]},
            )
        except jwt.PyJWTError as error:
            msg = f"invalid bearer token: {error}"
            raise InvalidTokenError(msg) from error

    def _identity(self, claims: dict[str, Any]) -> Identity:
        _refuse_odd_times(claims)
        names = self._claims
        # Bytes in UTF-8, the unit consumers bound the signed headers in: a value that fit in
        # characters but not in bytes was accepted here and refused by every consumer.
        user = _bounded_text(names.user, _claim_at(claims, names.user), MAX_USER_BYTES)
        tenant = _bounded_text(names.tenant, _claim_at(claims, names.tenant), MAX_TENANT_BYTES)
        roles = self._roles(claims)
        _refuse_control_characters(**{names.user: [user], names.tenant: [tenant], names.roles: roles})
        try:
            checked = check_roles(roles)  # the one check every way into a context makes
        except InvalidContextError as error:
            msg = f"invalid bearer token: {names.roles!r}: {error}"
            raise InvalidTokenError(msg) from None
        if flattened_size(checked) > MAX_ROLES_BYTES:
            msg = (
                f"invalid bearer token: {names.roles!r} must be at most {MAX_ROLES_BYTES} bytes in "
                f"UTF-8 comma-joined, got {flattened_size(checked)}"
            )
            raise InvalidTokenError(msg)
        return Identity(user_id=user, tenant_id=tenant, roles=checked)

    def _roles(self, claims: dict[str, Any]) -> list[str]:
        """The roles claim as a list: a list of strings, or one string of roles separated by
        commas or spaces (an OAuth scope); absent, none."""
        name = self._claims.roles
        roles = _claim_at(claims, name)
        if roles is None:
            return []
        if isinstance(roles, str):
            return [r for r in re.split(r"[, ]", roles) if r]
        if not isinstance(roles, list) or not all(isinstance(r, str) for r in roles):
            msg = f"invalid bearer token: {name!r} must be a list of strings"
            raise InvalidTokenError(msg)
        return roles


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name or "": it may resolve to (or mean) any interface
        return False


def _refuse_oversized(token: str) -> None:
    if len(token) > MAX_TOKEN_LENGTH:
        msg = f"invalid bearer token: longer than {MAX_TOKEN_LENGTH} characters"
        raise InvalidTokenError(msg)


def _claim_at(claims: dict[str, Any], name: str) -> object:
    if name in claims:
        return claims[name]
    value: object = claims
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _put_claim(claims: dict[str, Any], name: str, value: object) -> None:
    *path, last = name.split(".")
    for part in path:
        claims = claims.setdefault(part, {})
    claims[last] = value


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
