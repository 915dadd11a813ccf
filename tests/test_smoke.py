"""Tier 4, smoke: bake, install, migrate, start `python -m <package> run` as a real process,
wait for /readyz, place an order, see its notification, stop with SIGTERM: a clean exit."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from .support import bake, check, install

pytestmark = pytest.mark.smoke


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _request(url: str, *, token: str | None = None, body: object = None) -> tuple[int, object]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="POST" if body is not None else "GET")  # noqa: S310
    request.add_header("Content-Type", "application/json")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"null")


def _wait_ready(base: str, process: subprocess.Popen[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(
                f"the service exited early:\n{process.stderr.read() if process.stderr else ''}"
            )
        try:
            if _request(f"{base}/readyz")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.3)
    raise AssertionError("the service never became ready")


def test_service_runs_on_the_embedded_default(tmp_path: Path) -> None:
    project = bake(tmp_path)
    python = install(project)
    check([str(python), "-m", "order_service", "migrate"], project)
    token = check(
        [str(python), "-m", "order_service", "token", "--tenant", "acme", "--user", "alice"], project
    ).stdout.strip()
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [str(python), "-m", "order_service", "run", "--port", str(port)],
        cwd=project,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_ready(base, process)
        status, order = _request(
            f"{base}/orders",
            token=token,
            body={"customer_id": "c-1", "lines": [{"sku": "BOOK", "quantity": 2, "unit_price": "9.99"}]},
        )
        assert status == 201, order
        assert isinstance(order, dict)
        assert order["status"] == "placed"
        deadline = time.monotonic() + 20
        notifications: object = []
        while time.monotonic() < deadline and not notifications:
            _, notifications = _request(f"{base}/notifications?order_id={order['id']}", token=token)
            time.sleep(0.2)
        assert isinstance(notifications, list)
        assert [n["event_name"] for n in notifications] == ["orders.order-placed.v1"]
        assert notifications[0]["tenant_id"] == "acme"
        assert notifications[0]["user_id"] == "alice"
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
    _, stderr = process.communicate()
    assert code == 0, stderr[-3000:]
    assert "Application shutdown complete" in stderr
