"""Error tracking (``SENTRY__DSN``): the real Sentry SDK sends to an ingest endpoint the test
serves over HTTP; an unhandled error of a request arrives with the caller's tenant, user and
correlation id, and without the bearer token, the database password or a signing key."""

from __future__ import annotations

import gzip
import json
import threading
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
import sentry_sdk
from fastapi import APIRouter
from outbox_kit.application.observability import configure_error_tracking
from outbox_kit.runtime.container import OutboxContainer
from outbox_kit.testing.fixtures import live_server, token_for

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


def test_no_dsn_means_nothing_is_imported_or_sent() -> None:
    assert configure_error_tracking(dsn="", environment="test", release=None, sample_rate=1.0) is False
