"""Tier 5, journey: the README followed as a new user would, with real processes throughout.

1. The quick start: ``make demo`` bakes and starts a service; the commands its banner prints and
   the generated README's "in another terminal" block are run as written (with the port and the
   order id filled in), through bash and curl, and they place an order and read its notification.
   (``make test``, the other quick-start command, is what ``.ci/run`` runs: this test is part of it.)
2. Production shape: a service baked with a non-default broker (NATS), migrated onto a fresh
   PostgreSQL database, its API and its worker started as two processes (the worker with its own
   port). An order placed with a minted token reaches the consumer with the caller's tenant, user
   and correlation id; the worker's ``/metrics`` shows the relay and FastStream's counters.
3. A dead letter, end to end: a test-only context adds a handler that fails on purpose while a
   flag file exists; the order's event is dead-lettered, listed (CLI and admin API), explained,
   the cause removed, replayed, and delivered: its notification appears.

Needs PostgreSQL and NATS on localhost: skipped with the reason without them, failed with
``REQUIRE_SERVICES=1`` (CI).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from .support import REQUIRE_SERVICES, TEMPLATE, TOOLS_ENV, bake, check, install

pytestmark = pytest.mark.journey
POSTGRES = ("127.0.0.1", 5432)
NATS = ("127.0.0.1", 4222)
ORDER = {"customer_id": "c-1", "lines": [{"sku": "BOOK", "quantity": 2, "unit_price": "9.99"}]}

PROBE_MODULE = '''"""Test-only (written by the template's journey test): a second handler of OrderPlaced that
fails on purpose while the file named by JOURNEY_FAIL_FLAG exists."""

import os
from pathlib import Path

from outbox_kit.public import HandlerRegistry, Module, UnitOfWork

from ..orders.domain import OrderPlaced


async def fail_while_flagged(event: OrderPlaced, uow: UnitOfWork) -> None:
    del event, uow
    if Path(os.environ["JOURNEY_FAIL_FLAG"]).exists():
        msg = "failing on purpose: the journey flag is set"
        raise RuntimeError(msg)


def register_handlers(handlers: HandlerRegistry) -> None:
    handlers.on_domain_event(OrderPlaced, fail_while_flagged)


def module() -> Module:
    return Module(name="journey_probe", register_handlers=register_handlers)
'''


ON_THE_SERVER = """
import asyncio, asyncpg
async def main():
    connection = await asyncpg.connect("postgresql://postgres@127.0.0.1:5432/postgres")
    await connection.execute({statement!r})
    await connection.close()
asyncio.run(main())
"""


@contextmanager
def scratch_database(python: Path, project: Path) -> Iterator[str]:
    """A fresh PostgreSQL database (its URL), dropped afterwards."""
    name = f"journey_{uuid.uuid4().hex[:12]}"
    check([str(python), "-c", ON_THE_SERVER.format(statement=f"CREATE DATABASE {name}")], project)
    try:
        yield f"postgresql+asyncpg://postgres@127.0.0.1:5432/{name}"
    finally:
        drop = f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"
        check([str(python), "-c", ON_THE_SERVER.format(statement=drop)], project)


def answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def require(**services: tuple[str, int]) -> None:
    missing = [
        f"{name} on {host}:{port}" for name, (host, port) in services.items() if not answers(host, port)
    ]
    if not missing:
        return
    reason = f"the journey needs {' and '.join(missing)} (see docs/development.md)"
    if REQUIRE_SERVICES:
        pytest.fail(reason)
    pytest.skip(reason)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def http(
    url: str, *, token: str | None = None, body: object = None, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")  # noqa: S310
    request.add_header("Content-Type", "application/json")
    for name, value in (headers or {}).items():
        request.add_header(name, value)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310
            raw = response.read()
            kind = response.headers.get("Content-Type", "")
            return response.status, json.loads(raw or b"null") if "json" in kind else raw.decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def until(found: Callable[[], Any], what: str, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := found():
            return result
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


@contextmanager
def process(
    command: list[str], cwd: Path, log: Path, env: dict[str, str]
) -> Iterator[subprocess.Popen[bytes]]:
    """A real process group (``make`` and what it starts), output in ``log``; SIGTERM at the end."""
    with log.open("wb") as out:
        started = subprocess.Popen(
            command,
            cwd=cwd,
            env={**os.environ, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield started
    finally:
        if started.poll() is None:
            os.killpg(started.pid, signal.SIGTERM)
            try:
                started.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(started.pid, signal.SIGKILL)
                raise


def ready(base: str, started: subprocess.Popen[bytes], log: Path) -> Callable[[], bool]:
    def check_ready() -> bool:
        if started.poll() is not None:
            raise AssertionError(f"exited early:\n{log.read_text()[-4000:]}")
        try:
            return http(f"{base}/readyz")[0] == 200
        except OSError:
            return False

    return check_ready


def bash(script: str, cwd: Path) -> str:
    return check(["bash", "-euo", "pipefail", "-c", script], cwd).stdout


def test_the_quick_start_works_as_the_banner_and_the_readme_say(tmp_path: Path) -> None:
    if shutil.which("curl") is None:
        pytest.skip("the quick start's commands call curl, which is not installed here")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "demo.log"
    demo = TEMPLATE / "build" / "demo" / "order-service"
    env = {**TOOLS_ENV, "API__PORT": str(port)}
    with process(["make", "demo", f"PYTHON={sys.executable}"], TEMPLATE, log, env) as started:
        until(ready(base, started, log), "make demo to serve", timeout=600)
        banner = log.read_text()
        tries = [
            line.strip().removeprefix("Try:").strip()
            for line in banner.splitlines()
            if "curl" in line or "Try:" in line
        ]
        token_line, place, read_back = tries[0], tries[1], tries[2]
        assert token_line.startswith("TOKEN=$("), banner
        placed = json.loads(bash(f"{token_line}\n{place}", demo))
        assert placed["status"] == "placed", placed
        notifications = f"{token_line}\n{read_back.replace('<id>', placed['id'])}"
        seen = until(lambda: json.loads(bash(notifications, demo)), "the banner's notification call")
        assert [n["event_name"] for n in seen] == ["orders.order-placed.v1"]

        # The generated README's block, as written but for the port and the order id: the token
        # and the order first, then the read-back and `outbox pending` with the order's id.
        readme = (demo / "README.md").read_text()
        block = readme.split("Then, in another terminal:", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
        block = block.replace("http://127.0.0.1:8000", base)
        token_and_order, read_back_and_pending = block.split('curl -s "', 1)
        placed = json.loads(bash(token_and_order, demo))
        assert placed["status"] == "placed", placed
        token_only = token_and_order.split("\n", 1)[0]
        rest = 'curl -s "' + read_back_and_pending.replace("<id from above>", placed["id"])

        def read_back() -> str | None:
            out = bash(f"{token_only}\n{rest}", demo)
            return out if placed["id"] in out else None

        output = until(read_back, "the README's notification call")
        assert '"dead_lettered": 0' in output  # `outbox pending` printed its counts
    assert started.returncode is not None


@pytest.fixture
def nats_service(tmp_path: Path) -> Iterator[tuple[Path, Path, str]]:
    """A ``broker=nats`` bake with the test-only context, installed: (project, python, the URL of
    a fresh PostgreSQL database)."""
    require(PostgreSQL=POSTGRES, NATS=NATS)
    project = bake(tmp_path / "bake", broker="nats")
    probe = project / "src" / "order_service" / "contexts" / "journey_probe"
    probe.mkdir()
    (probe / "__init__.py").write_text("")
    (probe / "module.py").write_text(PROBE_MODULE)
    python = install(project)
    with scratch_database(python, project) as database:
        yield project, python, database


def test_a_new_user_runs_api_and_worker_on_postgresql_and_nats_and_replays_a_dead_letter(
    tmp_path: Path, nats_service: tuple[Path, Path, str]
) -> None:
    project, python, database = nats_service
    service = [str(python), "-m", "order_service"]
    flag = tmp_path / "fail-flag"
    env = {
        "DATABASE__URL": database,
        "MESSAGE_BUS__TRANSPORT": "nats",
        "APPLICATION__NAMESPACE": f"journey{uuid.uuid4().hex[:8]}",
        "OUTBOX__MAX_RETRIES": "2",  # a dead letter in seconds, not minutes
        "OUTBOX__RETRY_BACKOFF_BASE_SECONDS": "0.2",
        "OUTBOX__PROCESSING_DELAY_SECONDS": "0.2",
        "JOURNEY_FAIL_FLAG": str(flag),
    }
    check([*service, "migrate"], project, env=env)
    token = check(
        [*service, "token", "--tenant", "acme", "--user", "alice", "--roles", "outbox-admin"],
        project,
        env=env,
    ).stdout.strip()
    api_port, worker_port = free_port(), free_port()
    api, worker = f"http://127.0.0.1:{api_port}", f"http://127.0.0.1:{worker_port}"

    def outbox(*arguments: str) -> Any:
        return json.loads(check([*service, "outbox", *arguments], project, env=env).stdout)

    def notifications(order_id: str) -> list[dict[str, Any]]:
        status, found = http(f"{api}/notifications?order_id={order_id}", token=token)
        assert status == 200, found
        return list(found)

    def place(correlation_id: str) -> str:
        status, order = http(
            f"{api}/orders", token=token, body=ORDER, headers={"X-Correlation-Id": correlation_id}
        )
        assert status == 201, order
        return str(order["id"])

    with (
        process(
            [*service, "worker", "--port", str(worker_port)], project, tmp_path / "worker.log", env
        ) as worker_process,
        process(
            [*service, "api", "--port", str(api_port)], project, tmp_path / "api.log", env
        ) as api_process,
    ):
        until(ready(worker, worker_process, tmp_path / "worker.log"), "the worker's /readyz")
        until(ready(api, api_process, tmp_path / "api.log"), "the API's /readyz")

        first = place("journey-1")
        (seen,) = until(lambda: notifications(first), "the consumer's effect of the first order")
        assert (seen["tenant_id"], seen["user_id"], seen["correlation_id"]) == ("acme", "alice", "journey-1")
        status, metrics = http(f"{worker}/metrics")
        assert status == 200
        # The integration event's row (the API ran the domain event's handlers right after its commit).
        assert counter(metrics, "outbox_dispatched_total", 'source="outbox"') >= 1
        assert counter(metrics, "inbox_consumed_total", 'consumer="notifications.order-placed"') == 1
        assert counter(metrics, "faststream_received_messages_total", "") >= 1  # FastStream's own, NATS

        dead_letter_then_replay(flag, place, notifications, outbox, api, token)
    for name, started in (("worker", worker_process), ("api", api_process)):
        assert started.returncode == 0, f"{name}:\n{(tmp_path / f'{name}.log').read_text()[-3000:]}"


def counter(metrics: str, name: str, labels: str) -> float:
    """The sum of a Prometheus counter's samples whose labels contain ``labels``."""
    pattern = re.compile(rf"^{name}\{{([^}}]*)\}} ([0-9.e+]+)$", re.MULTILINE)
    return sum(float(value) for found, value in pattern.findall(metrics) if labels in found)


def dead_letter_then_replay(  # noqa: PLR0917 (the journey's handles, passed once)
    flag: Path,
    place: Callable[[str], str],
    notifications: Callable[[str], list[dict[str, Any]]],
    outbox: Callable[..., Any],
    api: str,
    token: str,
) -> None:
    """The handler fails while ``flag`` exists: the order's event is dead-lettered, listed,
    explained; the flag removed (the cause fixed), it is replayed and delivered."""
    flag.touch()
    second = place("journey-2")
    (dead,) = until(lambda: outbox("dead-letters"), "the dead letter")
    assert (dead["name"], dead["reason"]) == ("orders.domain.order-placed.v1", "retries_exhausted"), dead
    assert "failing on purpose" in dead["last_error"], dead
    status, listed = http(f"{api}/admin/outbox/dead-letters", token=token)
    assert status == 200, listed
    assert [row["id"] for row in listed] == [dead["id"]]
    explained = outbox("explain", dead["id"])
    assert explained["state"] == "dead_lettered", explained
    assert notifications(second) == []  # the event stopped with its row: nothing announced it

    flag.unlink()  # the cause is fixed
    replayed = outbox("replay", "--actor", "journey", dead["id"])
    assert (replayed["replayed"], replayed["replayed_by"]) == ([dead["id"]], "journey"), replayed
    until(lambda: outbox("explain", dead["id"])["state"] == "processed", "the replayed row to be delivered")
    (late,) = until(lambda: notifications(second), "the consumer's effect of the replayed event")
    assert (late["tenant_id"], late["correlation_id"]) == ("acme", "journey-2")
    pending = outbox("pending")
    assert all(row["pending"] == 0 and row["dead_lettered"] == 0 for row in pending), pending
