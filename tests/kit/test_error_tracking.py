"""Error tracking (``SENTRY__DSN``): the real Sentry SDK sends to an ingest endpoint the test
serves over HTTP; an unhandled error of a request arrives with the caller's tenant, user and
correlation id, and without the bearer token, the database password or a signing key.

Each error path that once carried a secret is provoked for real, and every byte the SDK sent is
searched for every secret of the process (issue 34): a failure inside the signer's verification
(its key a frame variable), the 503 of an unreachable identity provider (the caller's bearer
token a frame variable), an unhandled error of a request on PostgreSQL whose URL has a password,
and ERROR log records (and the breadcrumbs before them) whose text holds a token or a key."""

from __future__ import annotations

import gzip
import json
import logging
import socket
import threading
import zlib
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import jwt
import pytest
import sentry_sdk
import sqlalchemy as sa
from cryptography.hazmat.primitives.asymmetric import rsa
from fastapi import APIRouter, Depends
from outbox_kit.application.context import RequestContext
from outbox_kit.application.error_tracking import configure_error_tracking
from outbox_kit.runtime.container import OutboxContainer
from outbox_kit.runtime.http import authenticated
from outbox_kit.runtime.settings import secret_values
from outbox_kit.testing.fixtures import ContainerBuilder, live_server, make_settings, token_for
from outbox_kit.transports import envelope

pytestmark = pytest.mark.integration

LEAKY = "postgresql://app:hunter2-password@db.internal/app"
# Made at run time: Sentry sends the source lines around a frame, and a real key is not in them.
SIGNING_KEY = "-".join(("a", "signing", "key", "that", "must", "not", "leak"))


def events_of(body: bytes, encoding: str | None) -> list[dict[str, Any]]:
    """The events in one Sentry envelope (a header line, then item header and payload lines)."""
    if encoding == "gzip":
        body = gzip.decompress(body)
    elif encoding == "deflate":
        body = zlib.decompress(body)
    elif encoding == "br":
        pytest.fail("the SDK sent brotli: install brotli in the test environment or read it here")
    lines = body.split(b"\n")
    events = []
    for header, payload in zip(lines[1::2], lines[2::2], strict=False):
        if header and json.loads(header).get("type") == "event":
            events.append(json.loads(payload))
    return events


@pytest.fixture
def sentry() -> Iterator[tuple[str, list[dict[str, Any]], list[bytes]]]:
    """A Sentry ingest endpoint: (DSN, the events received, the raw bodies)."""
    events: list[dict[str, Any]] = []
    raw: list[bytes] = []

    class Ingest(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            raw.append(body)
            events.extend(events_of(body, self.headers.get("Content-Encoding")))
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *_: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Ingest)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://public-key@127.0.0.1:{server.server_address[1]}/42", events, raw
    sentry_sdk.get_client().close()
    sentry_sdk.init()  # no DSN: off again for the tests after this one
    server.shutdown()
    server.server_close()


failing = APIRouter()


@failing.get("/explode")
async def explode() -> None:
    signing_keys = {"k1": SIGNING_KEY}  # a frame variable Sentry would send
    msg = f"could not reach {LEAKY} with {len(signing_keys)} key"
    raise RuntimeError(msg)


async def test_an_unhandled_error_arrives_with_its_caller_and_without_secrets(
    container: OutboxContainer, sentry: tuple[str, list[dict[str, Any]], list[bytes]]
) -> None:
    dsn, events, raw = sentry
    assert configure_error_tracking(dsn=dsn, environment="test", release="1.2.3", sample_rate=1.0)
    token = token_for(container, tenant="acme", user="alice", roles=("clerk",))
    async with (
        live_server(container, with_worker=False, routers=[failing]) as base,
        httpx.AsyncClient(base_url=base) as client,
    ):
        answer = await client.get(
            "/explode", headers={"Authorization": f"Bearer {token}", "X-Correlation-Id": "checkout-7"}
        )
    assert answer.status_code == 500
    sentry_sdk.flush(timeout=10)
    (event,) = [e for e in events if e.get("exception")]
    assert event["tags"]["tenant_id"] == "acme"
    assert event["tags"]["correlation_id"] == "checkout-7"
    assert event["user"] == {"id": "alice"}
    assert (event["environment"], event["release"]) == ("test", "1.2.3")
    (error,) = event["exception"]["values"]
    assert error["value"] == "could not reach postgresql://app:***@db.internal/app with 1 key"
    everything = b"".join(gzip.decompress(b) if b[:2] == b"\x1f\x8b" else b for b in raw)
    for secret in (token, "hunter2-password", SIGNING_KEY):
        assert secret.encode() not in everything, secret


Sentry = tuple[str, list[dict[str, Any]], list[bytes]]


def report_errors(container: OutboxContainer, dsn: str) -> set[str]:
    """Error tracking on, as ``cli.configure_error_tracking`` turns it on; the secrets it hides."""
    secrets = secret_values(container.settings())
    assert configure_error_tracking(
        dsn=dsn, environment="test", release=None, sample_rate=1.0, secrets=secrets
    )
    return secrets


def sent_bytes(raw: list[bytes]) -> bytes:
    sentry_sdk.flush(timeout=10)
    return b"".join(gzip.decompress(body) if body[:2] == b"\x1f\x8b" else body for body in raw)


def assert_none_sent(raw: list[bytes], secrets: set[str]) -> None:
    everything = sent_bytes(raw)
    for secret in secrets:
        for spelling in (secret, json.dumps(secret)[1:-1], repr(secret.encode())[2:-1]):
            assert spelling.encode() not in everything, f"a secret of {len(secret)} characters was sent"


def frames_of(event: dict[str, Any]) -> list[dict[str, Any]]:
    return [frame for error in event["exception"]["values"] for frame in error["stacktrace"]["frames"]]


async def test_a_failure_inside_the_signers_verification_sends_no_key(
    make_container: Any, sentry: Sentry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The signer's key is a local variable of ``Signer.verify`` (once raised from there by a
    non-ASCII signature): an error raised in that frame and logged with its traceback, as the
    consumer logs a handler failure, arrives without the key, in any spelling."""
    dsn, events, raw = sentry
    container = make_container(message_bus={"signing_keys": {"k1": SIGNING_KEY}, "signing_key_id": "k1"})
    secrets = report_errors(container, dsn)
    assert SIGNING_KEY in secrets
    signer = container.signer()
    headers = signer.sign({"x-message-id": "m-1", "x-event-name": "counter.changed"}, b"{}")

    def broken(expected: bytes, given: bytes) -> bool:
        raise TypeError("comparing failed")

    monkeypatch.setattr(envelope.hmac, "compare_digest", broken)
    try:
        envelope.read_envelope(headers, b"{}", signer)
    except TypeError:
        logging.getLogger("outbox_kit.consume.subscribers").exception("message m-1 failed")
    assert_none_sent(raw, secrets)
    (event,) = [e for e in events if e.get("exception")]
    (verify,) = [f for f in frames_of(event) if f["function"] == "verify"]
    assert verify["vars"]["key"] == "[Filtered]"
    assert "k1" in verify["vars"]["self"]  # the signer's repr names its key ids only


def unreachable_url() -> str:
    with socket.socket() as probe:  # a port nothing listens on: connection refused
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}/certs"


whoami = APIRouter()


@whoami.get("/whoami")
def who(context: RequestContext = Depends(authenticated)) -> dict[str, Any]:
    return {"user": context.user_id}


async def test_the_503_of_an_unreachable_identity_provider_sends_no_bearer_token(
    make_container: Any, sentry: Sentry
) -> None:
    """The provider's keys cannot be fetched: the caller gets 503, and the event of it (the
    caller's ``HTTPAuthorizationCredentials`` a frame variable) arrives without the token."""
    dsn, events, raw = sentry
    issuer = "https://idp.example/realms/shop"
    container = make_container(
        auth={
            "jwks_url": unreachable_url(),
            "jwt_issuer": issuer,
            "jwt_audience": "shop",
            "tenant_claim": "org",
        }
    )
    secrets = report_errors(container, dsn)
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    now = datetime.now(UTC)
    claims = {
        "iss": issuer,
        "aud": "shop",
        "sub": "alice",
        "org": "acme",
        "iat": now,
        "exp": now + timedelta(minutes=5),
    }
    token = jwt.encode(claims, key, algorithm="RS256", headers={"kid": "k1"})
    async with (
        live_server(container, with_worker=False, routers=[whoami]) as base,
        httpx.AsyncClient(base_url=base) as client,
    ):
        answer = await client.get("/whoami", headers={"Authorization": f"Bearer {token}"})
    assert answer.status_code == 503, answer.text
    assert_none_sent(raw, secrets | {token, token.rsplit(".", 1)[0]})
    (event,) = [e for e in events if e.get("exception")]
    assert any("[Filtered]" in str(frame.get("vars")) for frame in frames_of(event))


DB_PASSWORD = "-".join(("db", "password", "not", "for", "sentry"))


@pytest.mark.postgres
async def test_an_unhandled_error_on_postgresql_sends_no_password_token_or_secret(
    postgres_url: str, container_builder: ContainerBuilder, sentry: Sentry
) -> None:
    """PostgreSQL (trust) ignores the password the URL carries, so the settings, a frame
    variable of the failing request, hold one; the request carries a bearer token."""
    dsn, events, raw = sentry
    url = sa.engine.make_url(postgres_url).set(password=DB_PASSWORD).render_as_string(hide_password=False)
    container = container_builder(make_settings(url))
    secrets = report_errors(container, dsn)
    assert {DB_PASSWORD, container.settings().auth.jwt_secret.get_secret_value()} <= secrets
    token = token_for(container, tenant="acme", user="alice", roles=("clerk",))
    broken = APIRouter()

    @broken.get("/broken")
    async def broken_query() -> None:
        settings = container.settings()  # frame variables: the URL, in the settings' repr too
        database_url = settings.database.url
        assert database_url
        async with container.database().session() as session:
            await session.execute(sa.text("SELECT * FROM no_such_table"))

    try:
        async with (
            live_server(container, with_worker=False, routers=[broken]) as base,
            httpx.AsyncClient(base_url=base) as client,
        ):
            answer = await client.get("/broken", headers={"Authorization": f"Bearer {token}"})
    finally:
        await container.data_sources().dispose()
    assert answer.status_code == 500
    assert_none_sent(raw, secrets | {token})
    (event,) = [e for e in events if e.get("exception")]
    (frame,) = [f for f in frames_of(event) if f["function"] == "broken_query"]
    assert "postgresql+asyncpg://postgres:***@" in frame["vars"]["database_url"]
    assert event["user"] == {"id": "alice"}


async def test_error_log_records_and_their_breadcrumbs_send_no_token_or_key(
    container: OutboxContainer, sentry: Sentry
) -> None:
    """A token or a key in a log record's text: the breadcrumb a WARNING record leaves and the
    event an ERROR record makes arrive without it, by value and by shape."""
    dsn, events, raw = sentry
    secrets = report_errors(container, dsn)
    jwt_secret = container.settings().auth.jwt_secret.get_secret_value()
    token = token_for(container)
    log = logging.getLogger("outbox_kit.test.scrubbing")
    log.warning("calling the provider with Authorization: Bearer %s", token)
    log.error("the provider refused %s (secret %r)", token, jwt_secret)
    assert_none_sent(raw, secrets | {token})
    (event,) = [e for e in events if e.get("logentry")]
    assert "[Filtered]" in json.dumps(event["logentry"])
    crumbs = event["breadcrumbs"]["values"]
    assert any("Bearer [Filtered]" in (crumb.get("message") or "") for crumb in crumbs), crumbs


def test_no_dsn_means_nothing_is_imported_or_sent() -> None:
    assert configure_error_tracking(dsn="", environment="test", release=None, sample_rate=1.0) is False
