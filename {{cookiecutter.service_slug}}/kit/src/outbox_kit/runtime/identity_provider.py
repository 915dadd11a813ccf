"""The signing keys of an OpenID Connect provider (its JWKS), fetched and kept for the bearer
tokens the API verifies.

Three promises, each against a provider that misbehaves:

* A fetch is bounded as a whole: ``timeout_seconds`` from its first byte sent to its last byte
  read, the discovery document included, so a provider sending its key set a byte at a time
  cannot hold anyone (a per-read timeout alone is reset by every byte). Each document is read
  in chunks up to :data:`MAX_DOCUMENT_BYTES`, never further.
* One fetch at a time, shared: every request that needs the keys waits for the fetch under way
  (at most the rest of its time limit), and a request whose key is cached never waits at all;
  a stale cache is refreshed in the background while its keys keep verifying.
* A key the provider has just added verifies as soon as the provider serves it: a token naming
  an unknown ``kid`` fetches the keys again, unless the last fetch began less than
  ``refetch_seconds`` ago, so a flood of made-up kids costs the provider one request per
  interval, whatever its size.

The fetch itself is blocking (``urllib``) and runs in a thread; everything else stays on the
event loop.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import math
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import jwt
from jwt import PyJWK, PyJWKSet

from outbox_kit.application.text import shorten

log = logging.getLogger(__name__)

# A token naming a key we do not know fetches the provider's keys again, but at most this often:
# a rotated-in key verifies within seconds, and made-up kids cannot become a flood of fetches.
REFETCH_SECONDS = 1.0
# The largest discovery document or key set read (a real key set is a few kilobytes).
MAX_DOCUMENT_BYTES = 1 << 20
_CHUNK_BYTES = 1 << 16
SIGNING_USES = frozenset({None, "sig"})
# RecursionError: a document nested deeper than json can read (well within the size cap).
_FETCH_ERRORS = (jwt.PyJWKSetError, OSError, ValueError, RecursionError, http.client.HTTPException)


class InvalidTokenError(ValueError):
    """The bearer token is missing a claim, expired, or not signed by a key we trust."""


class KeysUnavailableError(InvalidTokenError):
    """The identity provider's keys could not be fetched and none cached verifies this token: the
    token may well be valid, so the caller is told to retry (503), not that it is refused."""


class ProviderKeys:
    """The signing keys an OpenID Connect provider publishes, from ``jwks_url`` or from the
    discovery document of ``issuer``, kept for ``cache_seconds``; ``timeout_seconds`` bounds a
    whole fetch, ``refetch_seconds`` the rate of fetches (see the module's docstring)."""

    def __init__(
        self,
        *,
        jwks_url: str = "",
        issuer: str = "",
        cache_seconds: float = 300.0,
        timeout_seconds: float = 5.0,
        refetch_seconds: float = REFETCH_SECONDS,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        if not (jwks_url or issuer):
            msg = "ProviderKeys needs the provider's jwks_url or its issuer"
            raise ValueError(msg)
        self._jwks_url = jwks_url
        self._issuer = issuer
        self._cache_seconds = cache_seconds
        self._timeout = timeout_seconds
        self._refetch_seconds = refetch_seconds
        self._monotonic = monotonic
        self._keys: dict[str, PyJWK] = {}
        self._fetched_at = -math.inf
        self._tried_at = -math.inf
        self._failure = ""
        self._refresh: asyncio.Task[None] | None = None
        self.fetches = 0  # fetches begun (read by tests and logs)

    async def key_for(self, kid: str | None) -> PyJWK:
        """The key that signed a token naming ``kid`` (``None``: the provider's only key)."""
        key = self._pick(kid)
        if key is not None:
            if self._monotonic() - self._fetched_at >= self._cache_seconds:
                self._refreshing()  # in the background: this request has its key
            return key
        refresh = self._refreshing()
        if refresh is not None:
            # Shielded: a request that goes away does not cancel the others' fetch. The fetch
            # ends within its own time limit, so neither does this wait last longer.
            await asyncio.shield(refresh)
            key = self._pick(kid)
        if key is not None:
            return key
        if self._failure:
            raise KeysUnavailableError(self._unavailable(self._failure))
        msg = (
            f"invalid bearer token: signed with a key the identity provider does not publish "
            f"(kid {shorten(str(kid))!r})"
        )
        raise InvalidTokenError(msg)

    def _pick(self, kid: str | None) -> PyJWK | None:
        if kid is None:
            return next(iter(self._keys.values())) if len(self._keys) == 1 else None
        return self._keys.get(kid)

    def _refreshing(self) -> asyncio.Task[None] | None:
        """The fetch under way, or a new one when the last began long enough ago; else None."""
        loop = asyncio.get_running_loop()
        if self._refresh is not None and not self._refresh.done() and self._refresh.get_loop() is loop:
            return self._refresh
        if self._monotonic() - self._tried_at < self._refetch_seconds:
            return None
        self._tried_at = self._monotonic()
        self.fetches += 1
        self._refresh = loop.create_task(self._fetch())
        return self._refresh

    def _unavailable(self, why: str) -> str:
        return f"the identity provider's signing keys are unavailable ({why}); retry shortly"

    async def _fetch(self) -> None:
        deadline = time.monotonic() + self._timeout
        try:
            async with asyncio.timeout(self._timeout):
                keys = await asyncio.to_thread(self._fetch_keys, deadline)
        except TimeoutError:
            self._failed(f"no complete answer within {self._timeout:g} s (AUTH__JWKS_TIMEOUT_SECONDS)")
        except _FETCH_ERRORS as error:
            self._failed(f"{type(error).__name__}: {shorten(str(error), 200)}")
        else:
            self._keys = keys
            self._fetched_at = self._monotonic()
            self._failure = ""

    def _failed(self, why: str) -> None:
        self._failure = why
        log.warning("could not fetch the identity provider's keys: %s", why)

    def _fetch_keys(self, deadline: float) -> dict[str, PyJWK]:
        """In a thread: the discovery document when needed, then the key set."""
        url = self._jwks_url or self._discovered_jwks_url(deadline)
        key_set = PyJWKSet.from_dict(read_json(url, deadline))
        return {key.key_id or "": key for key in key_set.keys if key.public_key_use in SIGNING_USES}

    def _discovered_jwks_url(self, deadline: float) -> str:
        url = self._issuer.rstrip("/") + "/.well-known/openid-configuration"
        document = read_json(url, deadline)
        if document.get("issuer") != self._issuer:
            # OpenID Connect Discovery 4.3: a document naming another issuer is not trusted.
            got = shorten(str(document.get("issuer")))
            msg = f"the discovery document at {url} names issuer {got!r}, not {self._issuer!r}"
            raise ValueError(msg)
        jwks_uri = document.get("jwks_uri")
        if not isinstance(jwks_uri, str) or not jwks_uri.startswith(("https://", "http://")):
            msg = f"the discovery document at {url} has no http(s) jwks_uri"
            raise ValueError(msg)
        return jwks_uri


def read_json(url: str, deadline: float) -> dict[str, Any]:
    """The JSON object at ``url``, read whole before ``deadline`` (``time.monotonic``) and within
    :data:`MAX_DOCUMENT_BYTES`; ``TimeoutError`` or ``ValueError`` otherwise."""
    request = urllib.request.Request(url, headers={"Accept": "application/json"})  # noqa: S310
    # http(s) only: the settings refuse any other scheme.
    with urllib.request.urlopen(request, timeout=_remaining(deadline)) as response:  # noqa: S310
        declared = response.headers.get("Content-Length", "")
        if declared.isdigit() and int(declared) > MAX_DOCUMENT_BYTES:
            raise _too_large(url)
        body = bytearray()
        # read1: what has arrived, one socket read at most, so the deadline is checked between
        # reads (read(n) waits for n bytes, and a trickle resets the socket's timeout each byte).
        while chunk := response.read1(_CHUNK_BYTES):
            body += chunk
            if len(body) > MAX_DOCUMENT_BYTES:
                raise _too_large(url)
            _remaining(deadline)
    document = json.loads(body)
    if not isinstance(document, dict):
        msg = f"{url} did not answer a JSON object"
        raise ValueError(msg)  # noqa: TRY004 (a document the provider got wrong, as any other)
    return document


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        msg = "the identity provider's answer did not arrive in time"
        raise TimeoutError(msg)
    return left


def _too_large(url: str) -> ValueError:
    return ValueError(f"{url} answered a document larger than {MAX_DOCUMENT_BYTES} bytes")
