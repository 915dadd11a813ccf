"""Tokens of an OpenID Connect provider: real RSA and EC key pairs, their public halves served as a
JWKS (and a discovery document) over HTTP by the test, the service verifying what the provider
would sign, mapping its claims by settings, and refusing everything else."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from fastapi import APIRouter, Depends
from jwt.algorithms import ECAlgorithm, RSAAlgorithm
from outbox_kit.application.context import RequestContext
from outbox_kit.runtime.container import OutboxContainer
from outbox_kit.runtime.http import authenticated
from outbox_kit.runtime.identity_provider import InvalidTokenError, KeysUnavailableError, ProviderKeys
from outbox_kit.runtime.settings import AuthSettings
from outbox_kit.runtime.tokens import ClaimNames, SharedSecretTokens, TokenService
from outbox_kit.testing.fixtures import fresh_sqlite, live_server, make_settings
from pydantic import ValidationError

pytestmark = pytest.mark.integration
AUDIENCE = "order-service"
SECRET = "unit-test-secret-of-at-least-32-bytes!"


@dataclass
class SigningKey:
    kid: str
    algorithm: str
    private: Any

    def jwk(self) -> dict[str, Any]:
        to_jwk = RSAAlgorithm.to_jwk if self.algorithm.startswith(("RS", "PS")) else ECAlgorithm.to_jwk
        public = json.loads(to_jwk(self.private.public_key()))
        return public | {"kid": self.kid, "alg": self.algorithm, "use": "sig"}

    def sign(self, claims: dict[str, Any], **header: Any) -> str:
        return jwt.encode(claims, self.private, algorithm=self.algorithm, headers={"kid": self.kid} | header)


def rsa_key(kid: str) -> SigningKey:
    return SigningKey(kid, "RS256", rsa.generate_private_key(public_exponent=65537, key_size=2048))


def ec_key(kid: str) -> SigningKey:
    return SigningKey(kid, "ES256", ec.generate_private_key(ec.SECP256R1()))


@dataclass
class Provider:
    """A provider's public face: discovery document and JWKS, what it publishes changeable."""

    base: str = ""
    published: list[SigningKey] = field(default_factory=list)
    down: bool = False
    key_set_requests: int = 0
    # The key set sent one byte every ``trickle`` seconds (0: at once).
    trickle: float = 0.0
    trickles_started: int = 0
    trickles_finished: int = 0
    # Appended after the key set's last key ("padding"), streamed in 64 KiB writes.
    padding_bytes: int = 0
    declare_length: bool = True  # False: no Content-Length, the body ends when the connection does
    body_bytes_sent: int = 0
    stopping: threading.Event = field(default_factory=threading.Event)

    @property
    def issuer(self) -> str:
        return f"{self.base}/realms/shop"

    @property
    def jwks_url(self) -> str:
        return f"{self.issuer}/protocol/openid-connect/certs"

    def claims(self, **overrides: Any) -> dict[str, Any]:
        now = datetime.now(UTC)
        return {
            "iss": self.issuer,
            "aud": AUDIENCE,
            "sub": "3f1c-user",
            "preferred_username": "alice",
            "org": "acme",
            "realm_access": {"roles": ["clerk", "outbox-admin"]},
            "iat": now,
            "exp": now + timedelta(minutes=5),
        } | overrides


@pytest.fixture
def provider() -> Iterator[Provider]:
    state = Provider()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if state.down:
                self.send_error(503)
                return
            if self.path == "/realms/shop/.well-known/openid-configuration":
                body: dict[str, Any] = {"issuer": state.issuer, "jwks_uri": state.jwks_url}
            elif self.path == "/realms/shop/protocol/openid-connect/certs":
                state.key_set_requests += 1
                body = {"keys": [key.jwk() for key in state.published]}
            else:
                self.send_error(404)
                return
            encoded = json.dumps(body).encode()
            if state.padding_bytes:
                encoded = encoded[:-1] + b', "padding": "' + b"x" * state.padding_bytes + b'"}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            if state.declare_length:
                self.send_header("Content-Length", str(len(encoded)))
            self.end_headers()
            try:
                self._send(encoded)
            except OSError:  # the service stopped reading: what matters is how much it took
                return

        def _send(self, encoded: bytes) -> None:
            if state.trickle and self.path.endswith("/certs"):
                state.trickles_started += 1
                for offset in range(len(encoded)):
                    if state.stopping.wait(state.trickle):
                        return
                    self.wfile.write(encoded[offset : offset + 1])
                    self.wfile.flush()
                    state.body_bytes_sent += 1
                state.trickles_finished += 1
                return
            for offset in range(0, len(encoded), 1 << 16):
                chunk = encoded[offset : offset + (1 << 16)]
                self.wfile.write(chunk)
                state.body_bytes_sent += len(chunk)

        def log_message(self, *_: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state.base = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state
    state.stopping.set()
    server.shutdown()
    server.server_close()


KEYCLOAK_CLAIMS = {
    "user_claim": "preferred_username",
    "tenant_claim": "org",
    "roles_claim": "realm_access.roles",
}

whoami = APIRouter()


@whoami.get("/whoami")
def who(context: RequestContext = Depends(authenticated)) -> dict[str, Any]:
    return {"user": context.user_id, "tenant": context.tenant_id, "roles": list(context.roles)}


@pytest.fixture
async def service_of(tmp_path: Path, sqlite_template: Path, container_builder: Any) -> Any:
    """Containers on a SQLite copy, with the auth settings given."""
    built: list[OutboxContainer] = []

    def build(**auth: Any) -> OutboxContainer:
        folder = tmp_path / uuid.uuid4().hex
        folder.mkdir()
        url = fresh_sqlite(folder, sqlite_template)
        container: OutboxContainer = container_builder(make_settings(url, auth=auth))
        built.append(container)
        return container

    yield build
    for container in built:
        await container.database().dispose()


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def test_a_provider_token_is_verified_with_its_published_key_and_its_claims_mapped(
    provider: Provider, service_of: Any
) -> None:
    """Keycloak's shape: keys found through the issuer's discovery document, the user in
    ``preferred_username``, the tenant in ``org``, the roles under ``realm_access.roles``; the
    roles it carries open the admin API."""
    key = rsa_key("k1")
    provider.published = [key]
    container = service_of(oidc_issuer=provider.issuer, jwt_audience=AUDIENCE, **KEYCLOAK_CLAIMS)
    async with (
        live_server(container, with_worker=False, routers=[whoami]) as base,
        httpx.AsyncClient(base_url=base) as client,
    ):
        token = key.sign(provider.claims())
        me = await client.get("/whoami", headers=bearer(token))
        assert me.status_code == 200, me.text
        assert me.json() == {"user": "alice", "tenant": "acme", "roles": ["clerk", "outbox-admin"]}
        admin = await client.get("/admin/outbox/pending", params={"source": "outbox"}, headers=bearer(token))
        assert admin.status_code == 200, admin.text
        clerk = key.sign(provider.claims(realm_access={"roles": ["clerk"]}))
        assert (await client.get("/admin/outbox/pending", headers=bearer(clerk))).status_code == 403
    assert provider.key_set_requests == 1  # fetched once, then from the cache


async def test_es256_keys_from_a_jwks_url_with_several_algorithms(
    provider: Provider, service_of: Any
) -> None:
    rsa_signer, ec_signer = rsa_key("r1"), ec_key("e1")
    provider.published = [rsa_signer, ec_signer]
    container = service_of(
        jwks_url=provider.jwks_url,
        jwt_issuer=provider.issuer,
        jwt_audience=AUDIENCE,
        jwt_algorithms="RS256,ES256",
        tenant_claim="org",
    )
    async with (
        live_server(container, with_worker=False, routers=[whoami]) as base,
        httpx.AsyncClient(base_url=base) as client,
    ):
        for signer in (ec_signer, rsa_signer):
            answer = await client.get("/whoami", headers=bearer(signer.sign(provider.claims())))
            assert answer.status_code == 200, answer.text
            assert answer.json()["user"] == "3f1c-user"


def forged_tokens(provider: Provider, key: SigningKey) -> dict[str, tuple[str, str]]:
    """Tokens the service must refuse, with a word its 401 names."""
    stranger = rsa_key("k1")  # a key of the same name the provider never published
    public_pem = key.private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    unsigned = jwt.encode(provider.claims(), key=None, algorithm="none", headers={"kid": "k1"})
    return {
        "another audience": (key.sign(provider.claims(aud="billing-service")), "audience"),
        "another issuer": (key.sign(provider.claims(iss="https://evil.example/realms/shop")), "issuer"),
        "expired": (key.sign(provider.claims(exp=datetime.now(UTC) - timedelta(minutes=1))), "expired"),
        "no audience": (key.sign({k: v for k, v in provider.claims().items() if k != "aud"}), "aud"),
        "signed by a stranger": (stranger.sign(provider.claims()), "Signature"),
        "unpublished key": (rsa_key("k9").sign(provider.claims()), "does not publish"),
        "alg none": (unsigned, "algorithm"),
        # The public key used as an HMAC secret: the classic confusion attack.
        # The public key used as an HMAC secret: the classic algorithm confusion.
        "public key as HMAC secret": (_hmac_with(public_pem, provider.claims()), "algorithm"),
        "no tenant": (key.sign({k: v for k, v in provider.claims().items() if k != "org"}), "org"),
    }


def _hmac_with(secret: bytes, claims: dict[str, Any]) -> str:
    # PyJWT refuses to sign with a PEM as an HMAC key, as an attacker's tool would not.

    def part(value: dict[str, Any]) -> str:
        raw = json.dumps(value, default=lambda d: int(d.timestamp())).encode()
        return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()

    signing_input = f"{part({'alg': 'HS384', 'typ': 'JWT', 'kid': 'k1'})}.{part(claims)}"
    signature = hmac.new(secret, signing_input.encode(), hashlib.sha384).digest()
    return f"{signing_input}.{base64.urlsafe_b64encode(signature).rstrip(b'=').decode()}"


async def test_tokens_the_provider_did_not_issue_for_this_service_are_refused(
    provider: Provider, service_of: Any
) -> None:
    key = rsa_key("k1")
    provider.published = [key]
    container = service_of(oidc_issuer=provider.issuer, jwt_audience=AUDIENCE, tenant_claim="org")
    async with (
        live_server(container, with_worker=False, routers=[whoami]) as base,
        httpx.AsyncClient(base_url=base) as client,
    ):
        for label, (token, reason) in forged_tokens(provider, key).items():
            answer = await client.get("/whoami", headers=bearer(token))
            assert answer.status_code == 401, label
            assert reason.lower() in answer.json()["detail"].lower(), (label, answer.json())
        assert (await client.get("/whoami", headers=bearer(key.sign(provider.claims())))).status_code == 200


class FakeMonotonic:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def provider_tokens(provider: Provider, clock: FakeMonotonic, **keys: Any) -> TokenService:
    return TokenService(
        secret=SECRET,
        issuer=provider.issuer,
        audience=AUDIENCE,
        clock=lambda: datetime.now(UTC),
        claims=ClaimNames(tenant="org"),
        provider=ProviderKeys(jwks_url=provider.jwks_url, monotonic=clock, **keys),
        shared_secret_tokens=SharedSecretTokens.LOOPBACK,
    )


async def test_a_rotated_key_is_fetched_once_and_forged_key_names_cannot_flood_the_provider(
    provider: Provider,
) -> None:
    old, new = rsa_key("2026-11"), rsa_key("2026-12")
    provider.published = [old]
    clock = FakeMonotonic()
    tokens = provider_tokens(provider, clock, refetch_seconds=30)
    assert (
        await tokens.authenticate(old.sign(provider.claims()), client_host="10.1.2.3")
    ).tenant_id == "acme"
    provider.published = [old, new]  # the provider rotates: the new key is published, then used
    clock.now += 31
    assert (
        await tokens.authenticate(new.sign(provider.claims()), client_host="10.1.2.3")
    ).user_id == "3f1c-user"
    assert provider.key_set_requests == 2
    for n in range(20):  # made-up key names: one fetch at most per 30 s, whatever the flood
        with pytest.raises(InvalidTokenError, match="does not publish"):
            await tokens.authenticate(rsa_key(f"forged-{n}").sign(provider.claims()), client_host="10.1.2.3")
    assert provider.key_set_requests == 2
    clock.now += 31
    with pytest.raises(InvalidTokenError, match="does not publish"):
        await tokens.authenticate(rsa_key("forged-late").sign(provider.claims()), client_host="10.1.2.3")
    assert provider.key_set_requests == 3


async def test_a_key_the_provider_just_added_verifies_at_once_and_a_flood_of_made_up_kids_is_one_fetch(
    provider: Provider,
) -> None:
    """A rotation: the provider serves a new key and signs with it. A few seconds after the last
    fetch (not 30) the first token naming it fetches the keys and verifies; 2,000 concurrent
    tokens naming made-up keys cost the provider one request."""
    old, new = rsa_key("2026-11"), rsa_key("2026-12")
    provider.published = [old]
    clock = FakeMonotonic()
    tokens = provider_tokens(provider, clock)  # the default interval between fetches
    assert (await tokens.authenticate(old.sign(provider.claims()), client_host=None)).tenant_id == "acme"
    early = new.sign(provider.claims())  # signed before the provider serves the key
    with pytest.raises(InvalidTokenError, match="does not publish"):
        await tokens.authenticate(early, client_host=None)
    provider.published = [old, new]
    clock.now += 5
    assert (await tokens.authenticate(early, client_host=None)).user_id == "3f1c-user"
    assert provider.key_set_requests == 2

    clock.now += 5
    claims = provider.claims()
    forged = [old.sign(claims, kid=f"forged-{n}") for n in range(2000)]
    answers = await asyncio.gather(
        *(tokens.authenticate(token, client_host=None) for token in forged), return_exceptions=True
    )
    assert all(isinstance(a, InvalidTokenError) and "does not publish" in str(a) for a in answers)
    assert provider.key_set_requests == 3  # one fetch for the whole flood
    assert (await tokens.authenticate(new.sign(claims), client_host=None)).tenant_id == "acme"


async def test_a_trickling_key_set_is_cut_at_the_fetch_limit_and_cached_keys_never_wait_for_it(
    provider: Provider, service_of: Any
) -> None:
    """The provider sends its key set one byte at a time: requests needing it answer 503 once
    the fetch limit has passed (long before the provider finished), concurrently, through one
    fetch; a request whose key is cached answers 200 while a trickling refresh is under way."""
    known, unknown = rsa_key("k1"), rsa_key("k2")
    provider.published = [known]
    provider.trickle = 0.2  # the key set's ~500 bytes would take ~100 s
    container = service_of(
        jwks_url=provider.jwks_url,
        jwt_issuer=provider.issuer,
        jwt_audience=AUDIENCE,
        tenant_claim="org",
        jwks_timeout_seconds=1,
        jwks_cache_seconds=0.5,
        jwks_refetch_seconds=0.1,
    )
    token = known.sign(provider.claims())
    async with (
        live_server(container, with_worker=False, routers=[whoami]) as base,
        httpx.AsyncClient(base_url=base, timeout=60) as client,
    ):
        answers = await asyncio.gather(*(client.get("/whoami", headers=bearer(token)) for _ in range(8)))
        assert [a.status_code for a in answers] == [503] * 8, [a.text for a in answers]
        assert "unavailable" in answers[0].json()["detail"]
        assert provider.trickles_started == 1  # one fetch for every waiting request
        assert provider.trickles_finished == 0  # answered long before the provider finished

        provider.trickle = 0
        await until_status(client, token, 200)
        provider.trickle = 0.2
        started = provider.trickles_started
        while provider.trickles_started == started:  # the cache goes stale: a refresh trickles
            answer = await client.get("/whoami", headers=bearer(token))
            assert answer.status_code == 200, answer.text
        for _ in range(5):  # while that refresh is under way, the cached key answers at once
            answer = await client.get("/whoami", headers=bearer(token))
            assert answer.status_code == 200, answer.text
        refused = await client.get("/whoami", headers=bearer(unknown.sign(provider.claims())))
        assert refused.status_code == 503, refused.text
        assert provider.trickles_finished == 0


async def until_status(client: httpx.AsyncClient, token: str, status: int) -> None:
    deadline = time.monotonic() + 30
    while (await client.get("/whoami", headers=bearer(token))).status_code != status:
        assert time.monotonic() < deadline, f"never answered {status}"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "read-to-close"])
async def test_an_oversized_key_set_is_refused_and_read_no_further(
    provider: Provider, caplog: pytest.LogCaptureFixture, declared: bool
) -> None:
    """A 64 MiB key set is refused with a clear warning, the keys already fetched keep verifying,
    and the service stops reading at its cap: the provider could not send more than its socket
    buffers hold beyond it."""
    key = rsa_key("k1")
    provider.published = [key]
    clock = FakeMonotonic()
    tokens = provider_tokens(provider, clock)
    assert (await tokens.authenticate(key.sign(provider.claims()), client_host=None)).tenant_id == "acme"
    provider.padding_bytes = 64 << 20
    provider.declare_length = declared
    provider.body_bytes_sent = 0
    clock.now += 600
    with caplog.at_level(logging.WARNING, logger="outbox_kit"):
        with pytest.raises(KeysUnavailableError, match="larger than 1048576 bytes"):
            await tokens.authenticate(rsa_key("k2").sign(provider.claims()), client_host=None)
        # The cached key still verifies, answered at once while a refresh is not allowed yet.
        assert (await tokens.authenticate(key.sign(provider.claims()), client_host=None)).tenant_id == "acme"
    assert any("larger than 1048576 bytes" in r.getMessage() for r in caplog.records), caplog.text
    assert provider.body_bytes_sent < 16 << 20, provider.body_bytes_sent


async def test_while_the_provider_is_down_known_keys_keep_working_and_unknown_ones_answer_503(
    provider: Provider, service_of: Any
) -> None:
    key = rsa_key("k1")
    provider.published = [key]
    clock = FakeMonotonic()
    tokens = provider_tokens(provider, clock, cache_seconds=60, refetch_seconds=5)
    assert (await tokens.authenticate(key.sign(provider.claims()), client_host=None)).tenant_id == "acme"
    provider.down = True
    clock.now += 600  # the cache is stale and the provider answers 503
    assert (await tokens.authenticate(key.sign(provider.claims()), client_host=None)).tenant_id == "acme"
    with pytest.raises(KeysUnavailableError, match="unavailable"):
        await tokens.authenticate(rsa_key("k2").sign(provider.claims()), client_host=None)
    provider.down = False
    clock.now += 6
    provider.published = [key, rotated := rsa_key("k2")]
    assert (await tokens.authenticate(rotated.sign(provider.claims()), client_host=None)).tenant_id == "acme"

    # Over HTTP, a service that never reached its provider answers 503 with Retry-After: the
    # token may be good, the client should retry rather than log in again.
    provider.down = True
    container = service_of(
        jwks_url=provider.jwks_url, jwt_issuer=provider.issuer, jwt_audience=AUDIENCE, tenant_claim="org"
    )
    async with (
        live_server(container, with_worker=False, routers=[whoami]) as base,
        httpx.AsyncClient(base_url=base) as client,
    ):
        answer = await client.get("/whoami", headers=bearer(key.sign(provider.claims())))
    assert answer.status_code == 503, answer.text
    assert answer.headers["Retry-After"] == "5"
    assert "unavailable" in answer.json()["detail"]


async def test_shared_secret_tokens_beside_a_provider_only_from_loopback_in_development(
    provider: Provider,
) -> None:
    provider.published = [rsa_key("k1")]
    development = provider_tokens(provider, FakeMonotonic())
    dev_token = development.mint(user_id="alice", tenant_id="acme", roles=("clerk",))
    assert (await development.authenticate(dev_token, client_host="127.0.0.1")).tenant_id == "acme"
    assert (await development.authenticate(dev_token, client_host="::1")).tenant_id == "acme"
    with pytest.raises(InvalidTokenError, match="only from loopback in development"):
        await development.authenticate(dev_token, client_host="10.1.2.3")
    production = TokenService(
        secret=SECRET,
        issuer=provider.issuer,
        audience=AUDIENCE,
        clock=lambda: datetime.now(UTC),
        claims=ClaimNames(tenant="org"),
        provider=ProviderKeys(jwks_url=provider.jwks_url),
        shared_secret_tokens=SharedSecretTokens.NEVER,
    )
    with pytest.raises(InvalidTokenError, match="only from loopback in development"):
        await production.authenticate(dev_token, client_host="127.0.0.1")
    assert provider.key_set_requests == 0  # refused before any key was needed


async def test_the_openapi_document_declares_the_bearer_scheme(provider: Provider, service_of: Any) -> None:
    provider.published = [rsa_key("k1")]
    container = service_of(oidc_issuer=provider.issuer, jwt_audience=AUDIENCE)
    async with (
        live_server(container, with_worker=False, routers=[whoami]) as base,
        httpx.AsyncClient(base_url=base) as client,
    ):
        document = (await client.get("/openapi.json")).json()
    schemes = document["components"]["securitySchemes"]
    assert schemes["HTTPBearer"]["type"] == "http"
    assert schemes["HTTPBearer"]["scheme"] == "bearer"
    assert document["paths"]["/whoami"]["get"]["security"] == [{"HTTPBearer": []}]
    assert document["paths"]["/admin/outbox/pending"]["get"]["security"] == [{"HTTPBearer": []}]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"jwks_url": "https://idp.example/certs", "jwt_issuer": "https://idp.example"},
            "AUTH__JWT_AUDIENCE",
        ),
        ({"jwks_url": "https://idp.example/certs", "jwt_audience": AUDIENCE}, "AUTH__JWT_ISSUER"),
        (
            {"oidc_issuer": "https://idp.example", "jwt_audience": AUDIENCE, "jwt_algorithms": "RS256,HS256"},
            "JWT_ALGORITHMS",
        ),
        (
            {"oidc_issuer": "https://idp.example", "jwt_audience": AUDIENCE, "jwt_algorithms": "none"},
            "JWT_ALGORITHMS",
        ),
        ({"oidc_issuer": "ftp://idp.example", "jwt_audience": AUDIENCE}, "http"),
        ({"roles_claim": " "}, "claim name"),
    ],
)
def test_a_provider_configuration_that_would_accept_foreign_tokens_is_refused(
    values: dict[str, str], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        AuthSettings(**values)


def test_production_fetches_the_providers_keys_over_https_only() -> None:
    with pytest.raises(ValueError, match="https"):
        AuthSettings(oidc_issuer="http://idp.example", jwt_audience=AUDIENCE).refuse_in_production()
    AuthSettings(oidc_issuer="https://idp.example", jwt_audience=AUDIENCE).refuse_in_production()


def test_minted_development_tokens_carry_the_configured_claim_names() -> None:
    tokens = TokenService(
        secret=SECRET,
        clock=lambda: datetime.now(UTC),
        claims=ClaimNames(
            user="preferred_username", tenant="https://example.com/tenant", roles="realm_access.roles"
        ),
    )
    token = tokens.mint(user_id="alice", tenant_id="acme", roles=("clerk",))
    claims = jwt.decode(token, SECRET, algorithms=["HS256"])
    assert claims["preferred_username"] == "alice"
    assert claims["realm_access"] == {"roles": ["clerk"]}
    identity = tokens.verify(token)
    assert (identity.user_id, identity.tenant_id, identity.roles) == ("alice", "acme", ("clerk",))
