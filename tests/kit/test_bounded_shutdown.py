"""Every process exits within its configured shutdown time, whatever its database does: a request
stuck behind a table lock does not hold ``run`` past ``API__SHUTDOWN_TIMEOUT_SECONDS``, a worker
whose database line went silent (packets dropped, not refused) still exits, and ``/readyz``
answers 503 within ``API__READINESS_TIMEOUT_SECONDS`` instead of hanging; a trace collector that
accepts connections and never answers does not hold the exit either.

Real processes on PostgreSQL; the silent line is the test TCP proxy frozen (sockets open, no byte
forwarded). The asserted times are deadlines with a generous margin, never timings.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

import asyncpg
import httpx
import pytest
from outbox_kit.runtime.app import FORCED_EXIT_GRACE_SECONDS
from outbox_kit.testing.fixtures import (
    SERVICE_URLS,
    free_port,
    kit_container,
    make_settings,
    plain_dsn,
    service_process,
    token_for,
    until_answering,
)
from outbox_kit.testing.harness import TcpProxy, tcp_proxy
from outbox_kit.testing.processes import declared_topology
from sqlalchemy.engine import make_url

pytestmark = [pytest.mark.integration, pytest.mark.postgres, pytest.mark.slow]
# Room for a loaded machine (two cores, other suites running): these bound a hang, not a speed.
MARGIN = 15.0
QUICK = {"OUTBOX__POLLING_INTERVAL_SECONDS": "0.2", "OUTBOX__IDLE_POLLING_INTERVAL_SECONDS": "0.2"}
JWT_SECRET = "bounded-shutdown-test-secret-0123456789abcdef"
# Not Kafka: its client reaches the broker at the address the broker advertises, not through the
# proxy (only the bootstrap connection would freeze).
BROKERS = [
    pytest.param("rabbitmq", marks=pytest.mark.rabbitmq),
    pytest.param("nats", marks=pytest.mark.nats),
    pytest.param("redis", marks=pytest.mark.redis),
]


@asynccontextmanager
async def postgres_line(postgres_url: str) -> AsyncIterator[tuple[TcpProxy, str]]:
    """A line to the test's database that the test can freeze, and the URL through it."""
    url = make_url(postgres_url)
    async with tcp_proxy(url.host or "127.0.0.1", url.port or 5432) as proxy:
        yield proxy, url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)


async def exits_within(process: subprocess.Popen[str], seconds: float) -> int | None:
    """SIGTERM, then the exit status if the process ended within ``seconds`` (else None)."""
    process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + seconds
    while process.poll() is None and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return process.poll()


async def waiting_on_a_lock(admin: asyncpg.Connection, timeout: float = 30) -> None:
    """Until a statement of the service waits on a lock the test holds."""
    deadline = time.monotonic() + timeout
    query = (
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
    )
    while not await admin.fetchval(query):
        assert time.monotonic() < deadline, "no statement of the service waited on the lock"
        await asyncio.sleep(0.05)


async def test_run_exits_within_its_shutdown_time_with_a_request_stuck_in_a_handler(
    postgres_url: str,
) -> None:
    """A request blocked behind a table lock (held far longer than any shutdown time, and the
    statement timeout set longer still, so only the graceful-shutdown bound can end it)."""
    api_shutdown, outbox_shutdown = 2.0, 2.0
    port = free_port()
    token = token_for(
        kit_container(make_settings(postgres_url, auth={"jwt_secret": JWT_SECRET})), roles=("outbox-admin",)
    )
    admin = await asyncpg.connect(plain_dsn(postgres_url))
    try:
        with service_process(
            postgres_url,
            "run",
            "--port",
            str(port),
            AUTH__JWT_SECRET=JWT_SECRET,
            API__SHUTDOWN_TIMEOUT_SECONDS=str(api_shutdown),
            OUTBOX__SHUTDOWN_TIMEOUT_SECONDS=str(outbox_shutdown),
            DATABASE__STATEMENT_TIMEOUT_SECONDS="300",
            **QUICK,
        ) as process:
            base = f"http://127.0.0.1:{port}"
            await until_answering(f"{base}/livez", process)
            lock = admin.transaction()
            await lock.start()
            await admin.execute("LOCK TABLE outbox_messages IN ACCESS EXCLUSIVE MODE")
            async with httpx.AsyncClient(base_url=base, timeout=300) as client:
                stuck = asyncio.create_task(
                    client.get("/admin/outbox/pending", headers={"Authorization": f"Bearer {token}"})
                )
                await waiting_on_a_lock(admin)
                status = await exits_within(process, api_shutdown + 2 * outbox_shutdown + MARGIN)
                stuck.cancel()
                await asyncio.gather(stuck, return_exceptions=True)
            await lock.rollback()
            stderr = process.stderr.read() if status is not None else ""  # type: ignore[union-attr]
    finally:
        await admin.close()
    assert status == 0, f"run did not exit within its shutdown time (status {status}): {stderr}"


async def test_a_worker_whose_database_line_froze_exits_within_its_shutdown_time(postgres_url: str) -> None:
    outbox_shutdown = 2.0
    port = free_port()
    async with postgres_line(postgres_url) as (proxy, url):
        with service_process(
            url,
            "worker",
            "--port",
            str(port),
            OUTBOX__SHUTDOWN_TIMEOUT_SECONDS=str(outbox_shutdown),
            DATABASE__STATEMENT_TIMEOUT_SECONDS="300",
            **QUICK,
        ) as process:
            await until_answering(f"http://127.0.0.1:{port}/readyz", process)
            proxy.freeze()
            await asyncio.sleep(1.0)  # the processors' next statements are now stuck on the line
            status = await exits_within(process, 2 * outbox_shutdown + MARGIN)
            stderr = process.stderr.read() if status is not None else ""  # type: ignore[union-attr]
            if status is None:
                process.kill()  # not the helper's SIGTERM and 30 s wait: the line stays frozen
                process.wait()
            proxy.thaw()
    assert status == 0, f"the worker did not exit within its shutdown time (status {status}): {stderr}"


async def test_readyz_answers_503_within_its_check_timeout_when_the_database_line_froze(
    postgres_url: str,
) -> None:
    readiness_timeout = 1.0
    port = free_port()
    async with postgres_line(postgres_url) as (proxy, url):
        with service_process(
            url,
            "api",
            "--port",
            str(port),
            API__READINESS_TIMEOUT_SECONDS=str(readiness_timeout),
            API__SHUTDOWN_TIMEOUT_SECONDS="1",
        ) as process:
            base = f"http://127.0.0.1:{port}"
            await until_answering(f"{base}/readyz", process)
            proxy.freeze()
            async with httpx.AsyncClient(base_url=base, timeout=readiness_timeout + MARGIN) as client:
                try:
                    response = await client.get("/readyz")
                finally:
                    proxy.thaw()  # so the process stops as it always does
    assert response.status_code == 503, response.text
    assert response.json()["checks"]["database"].startswith("error: no answer within 1 s"), response.text
    assert response.json()["checks"]["bus"] == "ok"


async def test_a_request_on_a_frozen_database_line_answers_503_within_its_time_limits(
    postgres_url: str,
) -> None:
    """The line goes silent under a running ``api``: a request answers 503 once the driver's own
    time limit (statement timeout + 2 s) and the connect timeout have passed, instead of hanging."""
    statement_timeout, connect_timeout = 1.0, 1.0
    port = free_port()
    token = token_for(
        kit_container(make_settings(postgres_url, auth={"jwt_secret": JWT_SECRET})), roles=("outbox-admin",)
    )
    async with postgres_line(postgres_url) as (proxy, url):
        with service_process(
            url,
            "api",
            "--port",
            str(port),
            AUTH__JWT_SECRET=JWT_SECRET,
            DATABASE__STATEMENT_TIMEOUT_SECONDS=str(statement_timeout),
            DATABASE__CONNECT_TIMEOUT_SECONDS=str(connect_timeout),
            API__SHUTDOWN_TIMEOUT_SECONDS="1",
        ) as process:
            base = f"http://127.0.0.1:{port}"
            await until_answering(f"{base}/readyz", process)
            proxy.freeze()
            bound = 2 * (statement_timeout + 2) + connect_timeout + MARGIN  # pre-ping, then the query
            async with httpx.AsyncClient(base_url=base, timeout=bound) as client:
                try:
                    response = await client.get(
                        "/admin/outbox/pending", headers={"Authorization": f"Bearer {token}"}
                    )
                finally:
                    proxy.thaw()
    assert response.status_code == 503, response.text
    assert response.json()["code"] == "database_unavailable"


async def test_a_silent_trace_collector_does_not_hold_the_exit(postgres_url: str) -> None:
    """Spans waiting for export at SIGTERM, sent to a collector that accepts the connection and
    never answers (the exporter's own timeout set far past the deadline)."""
    api_shutdown, outbox_shutdown = 1.0, 2.0
    port = free_port()
    collector = socket.create_server(("127.0.0.1", 0))  # listens, never reads nor answers
    with (
        collector,
        service_process(
            postgres_url,
            "api",
            "--port",
            str(port),
            TELEMETRY__TRACING="otel",
            OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{collector.getsockname()[1]}",
            OTEL_EXPORTER_OTLP_TIMEOUT="120",
            OTEL_BSP_SCHEDULE_DELAY="100",  # the first export starts (and hangs) at once
            API__SHUTDOWN_TIMEOUT_SECONDS=str(api_shutdown),
            OUTBOX__SHUTDOWN_TIMEOUT_SECONDS=str(outbox_shutdown),
        ) as process,
    ):
        base = f"http://127.0.0.1:{port}"
        await until_answering(f"{base}/livez", process)
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            for _ in range(3):  # spans of their own (the probes have none)
                assert (await client.get("/asyncapi")).status_code == 200
                await asyncio.sleep(0.3)
        status = await exits_within(process, api_shutdown + outbox_shutdown + MARGIN)
        stderr = process.stderr.read() if status is not None else ""  # type: ignore[union-attr]
    assert status == 0, f"api did not exit within its shutdown time (status {status}): {stderr}"


def broker_address(url: str) -> tuple[str, int]:
    """Host and port of a broker URL (Kafka's is a bare ``host:port``)."""
    parsed = urlsplit(url if "://" in url else f"kafka://{url}")
    return parsed.hostname or "127.0.0.1", parsed.port or 0


@pytest.mark.parametrize("transport", BROKERS)
async def test_a_worker_whose_broker_line_froze_exits_within_its_shutdown_time(
    postgres_url: str, transport: str
) -> None:
    """The broker's line goes silent, then SIGTERM: closing the connection is abandoned at the
    deadline, and a client library that keeps waiting through the cancellation (NATS's did, for
    14 s) is cut short by the forced exit. The margin is tighter than the others' (such a
    library waits a fixed time of its own, whatever the shutdown timeout)."""
    outbox_shutdown = 1.0
    port = free_port()
    namespace = f"shutdown-{uuid.uuid4().hex[:8]}"
    host, broker_port = broker_address(SERVICE_URLS[transport])
    async with tcp_proxy(host, broker_port) as proxy:
        url = SERVICE_URLS[transport].replace(f"{host}:{broker_port}", f"127.0.0.1:{proxy.port}")
        with service_process(
            postgres_url,
            "worker",
            "--port",
            str(port),
            MESSAGE_BUS__TRANSPORT=transport,
            MESSAGE_BUS__URL=url,
            APPLICATION__NAMESPACE=namespace,
            OUTBOX__SHUTDOWN_TIMEOUT_SECONDS=str(outbox_shutdown),
            **QUICK,
        ) as process:
            await until_answering(f"http://127.0.0.1:{port}/readyz", process)
            proxy.freeze()
            await asyncio.sleep(0.5)  # whatever the worker sends now is stuck on the line
            status = await exits_within(process, 2 * outbox_shutdown + FORCED_EXIT_GRACE_SECONDS + 6)
            stderr = process.stderr.read() if status is not None else ""  # type: ignore[union-attr]
            if status is None:
                process.kill()
                process.wait()
            proxy.thaw()
    # What the worker declared (its consumer's queues or stream), deleted: the broker as found.
    bus = {"transport": transport, "url": SERVICE_URLS[transport]}
    async with declared_topology(kit_container, postgres_url, namespace, "kit.observer", bus):
        pass
    assert status == 0, f"the worker did not exit within its shutdown time (status {status}): {stderr}"
