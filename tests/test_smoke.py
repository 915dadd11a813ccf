"""Tier 4, smoke: bake, install, migrate, start `python -m <package> run` as a real process,
wait for /readyz, place an order, see its notification, stop with SIGTERM: a clean exit."""

from __future__ import annotations

import functools
import json
import os
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


def _description(base: str) -> object:
    _, document = _request(f"{base}/openapi.json")
    assert isinstance(document, dict)
    return document["info"]["description"]


# What Ctrl-C finds: a terminal's job answers it; a job a script put in the background (and CI
# runners that start the suite so) inherits it ignored, while the server it runs answers it all
# the same (uvicorn installs its own handler): the reloader must stop with it either way.
CTRL_C = {"terminal": signal.SIG_DFL, "background job": signal.SIG_IGN}


@pytest.mark.parametrize("started_from", CTRL_C)
def test_make_run_starts_again_when_the_code_changes(tmp_path: Path, started_from: str) -> None:
    """The development loop: `make run` (reload on by default) serves a change to the service's
    code without being restarted by hand, and stops cleanly with Ctrl-C."""
    project = bake(tmp_path)
    install(project)
    check(["make", "migrate"], project)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log = (tmp_path / "run.log").open("w")
    process = subprocess.Popen(
        ["make", "run", f"ARGS=--port {port}"],
        cwd=project,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's job is
        preexec_fn=functools.partial(signal.signal, signal.SIGINT, CTRL_C[started_from]),  # noqa: PLW1509
    )
    try:
        _wait_ready(base, process)
        about = project / "src" / "order_service" / "about.py"
        before = _description(base)
        edited = about.read_text().replace("DESCRIPTION: Final = ", 'DESCRIPTION: Final = "Reloaded. " + ')
        about.write_text(edited)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if _description(base) != before:
                    break
            except OSError:  # between the old process and the new one
                pass
            time.sleep(0.3)
        assert str(_description(base)).startswith("Reloaded. "), (tmp_path / "run.log").read_text()[-3000:]
        assert _request(f"{base}/readyz")[0] == 200
    finally:
        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C: to the whole job
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            raise
        log.close()
    output = (tmp_path / "run.log").read_text()
    assert "starting again" in output, output[-3000:]
    assert output.count("Application shutdown complete") == 2, output[-3000:]  # the old child's, the last's
    assert " ERROR " not in output, output[-3000:]  # Ctrl-C stops the child once, gracefully
