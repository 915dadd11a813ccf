"""Tier 4, smoke: bake, install, migrate, start `python -m <package> run` as a real process,
wait for /readyz, place an order, see its notification, stop with SIGTERM: a clean exit."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from .support import bake, check, free_port, http, install

pytestmark = pytest.mark.smoke


def _wait_ready(base: str, process: subprocess.Popen[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(
                f"the service exited early:\n{process.stderr.read() if process.stderr else ''}"
            )
        try:
            if http(f"{base}/readyz")[0] == 200:
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
    port = free_port()
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
        status, order = http(
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
            _, notifications = http(f"{base}/notifications?order_id={order['id']}", token=token)
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
