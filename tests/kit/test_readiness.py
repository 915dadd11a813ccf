"""Readiness tells the truth about the broker: ``/readyz`` makes a real round trip to it, bounded
by ``API__READINESS_TIMEOUT_SECONDS``, on every broker transport. A line that went silent (the
tests' TCP proxy stops forwarding but keeps the sockets open: a black hole, as after a failover
behind a load balancer) answers 503 within the time limit, and 200 again once the line flows.

Kafka's clients reach the broker at the address it advertises, not at the bootstrap address, so
the proxy can stand in the line only when the broker advertises the proxy: that test starts a
Kafka-protocol broker of its own (``tansu``, from ``TANSU_BIN`` or the ``PATH``)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from outbox_kit.testing.fixtures import (
    SERVICE_URLS,
    ContainerFactory,
    free_port,
    kafka_broker_of_its_own,
    live_server,
)
from outbox_kit.testing.harness import TcpProxy, tcp_proxy

pytestmark = pytest.mark.integration

READINESS_TIMEOUT = 1.0
MARGIN = 4.0  # a loaded machine: the answer's own way through the server
RECOVERY = 90.0  # a client library's own reconnect after the line flows again


def broker_address(url: str) -> tuple[str, int]:
    """Host and port of a broker URL (Kafka's is a bare ``host:port``)."""
    parsed = urlsplit(url if "://" in url else f"kafka://{url}")
    return parsed.hostname or "127.0.0.1", parsed.port or 0


def through(proxy: TcpProxy, url: str) -> str:
    host, port = broker_address(url)
    return url.replace(f"{host}:{port}", f"127.0.0.1:{proxy.port}")


async def ready_again(client: httpx.AsyncClient, deadline_seconds: float) -> httpx.Response:
    """The first 200 of ``/readyz`` within the deadline, else the last answer (or failure)."""
    deadline = asyncio.get_running_loop().time() + deadline_seconds
    answer: httpx.Response | None = None
    while True:
        try:
            answer = await client.get("/readyz")
            if answer.status_code == 200:
                return answer
        except httpx.TimeoutException:
            pass
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"/readyz not 200 again in {deadline_seconds} s: {answer and answer.text}")
        await asyncio.sleep(0.5)


async def black_hole_and_back(
    make_container: ContainerFactory, transport: str, proxy: TcpProxy, url: str
) -> None:
    container = make_container(
        message_bus={"transport": transport, "url": url},
        api={"readiness_timeout_seconds": READINESS_TIMEOUT},
        application={"namespace": f"ready-{uuid.uuid4().hex[:8]}"},
    )
    async with (
        live_server(container, with_worker=False) as base,
        httpx.AsyncClient(base_url=base, timeout=READINESS_TIMEOUT + MARGIN) as client,
    ):
        before = await client.get("/readyz")
        assert before.status_code == 200, before.text
        assert before.json()["checks"]["bus"] == "ok"
        proxy.freeze()
        try:
            await asyncio.sleep(0.2)  # whatever was in flight is now stuck on the line too
            # The client's own time limit is the bound: an answer after it fails the test.
            silent = await client.get("/readyz")
        finally:
            proxy.thaw()
        assert silent.status_code == 503, silent.text
        assert silent.json()["checks"]["bus"].startswith("error"), silent.text
        assert silent.json()["checks"]["database"] == "ok"
        back = await ready_again(client, RECOVERY)
        assert back.json()["checks"]["bus"] == "ok"
        await container.bus().delete_topology()  # type: ignore[attr-defined]  # leave the broker clean


@pytest.mark.parametrize(
    "transport",
    [
        pytest.param("rabbitmq", marks=pytest.mark.rabbitmq),
        pytest.param("nats", marks=pytest.mark.nats),
        pytest.param("redis", marks=pytest.mark.redis),
    ],
)
async def test_readyz_answers_503_within_its_limit_while_the_broker_line_is_silent_and_200_after(
    make_container: ContainerFactory, transport: str
) -> None:
    host, port = broker_address(SERVICE_URLS[transport])
    async with tcp_proxy(host, port) as proxy:
        await black_hole_and_back(make_container, transport, proxy, through(proxy, SERVICE_URLS[transport]))


@asynccontextmanager
async def proxy_on(port: int, target_port: int) -> AsyncIterator[TcpProxy]:
    proxy = TcpProxy("127.0.0.1", target_port)
    proxy.port = port
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.cut()


@pytest.mark.kafka
async def test_readyz_answers_503_within_its_limit_while_the_kafka_line_is_silent_and_200_after(
    make_container: ContainerFactory, tmp_path: Path
) -> None:
    advertised = free_port()
    with kafka_broker_of_its_own(tmp_path, advertised_port=advertised) as listening:
        async with proxy_on(advertised, listening) as proxy:
            await black_hole_and_back(make_container, "kafka", proxy, f"127.0.0.1:{proxy.port}")
