"""The worker can be watched: with a port it serves /livez, /readyz and /metrics (real processes,
scraped over HTTP); without one it serves nothing and says so; a taken port is one clear line;
/livez fails when a processor loop stops turning, and only then."""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import subprocess
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx
import pytest
from outbox_kit.runtime.container import OutboxContainer
from outbox_kit.testing.fixtures import (
    SERVICE_URLS,
    ContainerFactory,
    free_port,
    get,
    live_server,
    make_settings,
    service_argv,
    service_env,
    service_process,
    wait_for,
)

pytestmark = pytest.mark.integration
# Loops that sleep at most 0.2 s (idle or not), watched with a half-second timeout.
POLL, LIVENESS_TIMEOUT = 0.2, 1.0
QUICK_LIVENESS: dict[str, dict[str, Any]] = {
    "outbox": {"polling_interval_seconds": POLL, "idle_polling_interval_seconds": POLL},
    "worker": {"liveness_timeout_seconds": LIVENESS_TIMEOUT},
}


def worker_process(
    database_url: str, *arguments: str, **env: str
) -> AbstractContextManager[subprocess.Popen[str]]:
    return service_process(database_url, "worker", *arguments, **env)


def test_a_worker_with_a_port_serves_its_probes_and_its_metrics(sqlite_url: str) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with worker_process(sqlite_url, "--port", str(port)) as process:
        wait_for(f"{base}/livez", process)
        assert get(f"{base}/livez") == (200, '{"status":"ok"}')
        status, body = get(f"{base}/readyz")
        assert status == 200, body
        # The processors' own metrics: the heartbeat moves once a cycle has run.
        heartbeat = 'outbox_processor_heartbeat_timestamp_seconds{source="outbox"}'
        deadline = time.monotonic() + 30
        while heartbeat not in get(f"{base}/metrics")[1]:
            assert time.monotonic() < deadline, get(f"{base}/metrics")[1]
            time.sleep(0.2)
        assert get(f"{base}/admin/outbox/pending")[0] == 404  # the worker serves no API (the API does)
        assert get(f"{base}/docs")[0] == 404
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        stderr = process.stderr.read()  # type: ignore[union-attr]
    assert f"worker: /livez, /readyz and /metrics on {base}" in stderr


def test_the_worker_port_can_come_from_the_settings(sqlite_url: str) -> None:
    port = free_port()
    with worker_process(sqlite_url, WORKER__PORT=str(port)) as process:
        wait_for(f"http://127.0.0.1:{port}/livez", process)
        assert get(f"http://127.0.0.1:{port}/livez")[0] == 200


def test_a_worker_without_a_port_serves_nothing_and_says_so(sqlite_url: str) -> None:
    with worker_process(sqlite_url) as process:
        assert process.stderr is not None
        first = process.stderr.readline()
        assert "worker: no HTTP endpoint" in first, first
        assert "--port" in first
        assert "WORKER__PORT" in first
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0


@pytest.mark.parametrize("command", ["worker", "api", "run"])
def test_a_port_already_taken_is_one_clear_line(sqlite_url: str, command: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [*service_argv(), command, "--port", str(port)],
            env=service_env(sqlite_url, ENVIRONMENT="development"),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()  # no banner first, no traceback after
    assert line == (
        f"error: cannot listen on 127.0.0.1:{port}: already in use (pass --port, or stop what listens there)"
    )


async def livez_until(client: httpx.AsyncClient, status: int, within: float = 15) -> httpx.Response:
    """Poll ``/livez`` until it answers ``status``: the liveness timeout is a lower bound, and on a
    busy machine the loop may turn late, so a test waits for the state, never a fixed time."""
    deadline = time.monotonic() + within
    while True:
        response = await client.get("/livez")
        if response.status_code == status or time.monotonic() > deadline:
            return response
        await asyncio.sleep(0.1)


async def test_livez_fails_when_a_processor_loop_stops_turning(make_container: ContainerFactory) -> None:
    """A cycle that hangs (not one that fails: an outage is for /readyz) fails /livez once the
    liveness timeout passes; /livez recovers when the loop turns again."""
    container: OutboxContainer = make_container(**QUICK_LIVENESS)
    source = container.sources()[0]
    hang, release = asyncio.Event(), asyncio.Event()
    original = source.run_cycle

    async def hangs_once_told() -> Any:
        if hang.is_set():
            await release.wait()
        return await original()

    source.run_cycle = hangs_once_told  # type: ignore[method-assign]
    async with live_server(container) as base, httpx.AsyncClient(base_url=base) as client:
        assert (await livez_until(client, 200)).status_code == 200
        hang.set()
        stalled = await livez_until(client, 503)
        assert stalled.status_code == 503
        assert stalled.json()["status"] == "stalled"
        assert stalled.json()["stalled"][0].startswith(f"{source.name}: no turn for")
        release.set()
        assert (await livez_until(client, 200)).status_code == 200


async def test_a_failing_cycle_keeps_livez_up(make_container: ContainerFactory) -> None:
    container: OutboxContainer = make_container(**QUICK_LIVENESS)
    # well past the liveness timeout, counted in failed cycles rather than in seconds
    failures, enough = 0, 2 * len(container.sources()) * LIVENESS_TIMEOUT / POLL
    past_the_timeout = asyncio.Event()
    for source in container.sources():

        async def database_down() -> Any:
            nonlocal failures
            failures += 1
            if failures >= enough:
                past_the_timeout.set()
            msg = "connection refused"
            raise ConnectionRefusedError(msg)

        source.run_cycle = database_down  # type: ignore[method-assign]
    async with live_server(container) as base, httpx.AsyncClient(base_url=base) as client:
        await asyncio.wait_for(past_the_timeout.wait(), timeout=60)
        assert (await client.get("/livez")).status_code == 200


async def test_the_api_alone_has_no_loop_to_watch(make_container: ContainerFactory) -> None:
    container: OutboxContainer = make_container(**QUICK_LIVENESS)
    async with live_server(container, with_worker=False) as base, httpx.AsyncClient(base_url=base) as client:
        await asyncio.sleep(LIVENESS_TIMEOUT + POLL)
        assert (await client.get("/livez")).json() == {"status": "ok"}


def test_a_liveness_timeout_shorter_than_an_idle_sleep_is_refused(sqlite_url: str) -> None:
    with pytest.raises(ValueError, match="WORKER__LIVENESS_TIMEOUT_SECONDS \\(5\\) must be longer"):
        make_settings(sqlite_url, worker={"liveness_timeout_seconds": 5})


@pytest.mark.rabbitmq
def test_a_worker_log_written_to_a_file_is_plain_text(sqlite_url: str, tmp_path: Path) -> None:
    """FastStream's own records (a subscriber starting) come through the service's format, with
    no ANSI colour codes in a file (its default logger paints them even there)."""
    log_file = tmp_path / "worker.log"
    env = service_env(
        sqlite_url,
        MESSAGE_BUS__TRANSPORT="rabbitmq",
        MESSAGE_BUS__URL=SERVICE_URLS["rabbitmq"],
        APPLICATION__NAMESPACE="plain-log-test",
    )
    with log_file.open("w") as sink:
        process = subprocess.Popen([*service_argv(), "worker"], env=env, stderr=sink, text=True)
        deadline = time.monotonic() + 60
        while "worker started" not in log_file.read_text():
            assert process.poll() is None, log_file.read_text()
            assert time.monotonic() < deadline, log_file.read_text()
            time.sleep(0.1)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    text = log_file.read_text()
    assert "\x1b" not in text
    # The kit's service has one consumer (outbox_kit.testing.processes.harness_service).
    record = r"^\d{4}-\d\d-\d\d [\d:,]+ INFO +\S+\.faststream \[.*waiting for messages"
    assert re.search(record, text, re.MULTILINE), text


async def test_http_metrics_count_requests_per_route(make_container: ContainerFactory) -> None:
    """Per route, method and status, in the service's registry; probes and the scrape are not
    counted. Two apps on one container (as tests build them) share the metrics."""
    container: OutboxContainer = make_container()
    async with live_server(container, with_worker=False) as base, httpx.AsyncClient(base_url=base) as client:
        for _ in range(2):
            assert (await client.get("/asyncapi")).status_code == 200
        await client.get("/livez")
        exposition = (await client.get("/metrics")).text
    assert 'http_requests_total{handler="/asyncapi",method="GET",status="200"} 2.0' in exposition
    assert 'handler="/livez"' not in exposition
    async with live_server(container, with_worker=False) as base, httpx.AsyncClient(base_url=base) as client:
        assert (await client.get("/asyncapi")).status_code == 200
        exposition = (await client.get("/metrics")).text
    assert 'http_requests_total{handler="/asyncapi",method="GET",status="200"} 3.0' in exposition
