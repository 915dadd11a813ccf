"""Tier 4, smoke: the OpenAPI document is exact. Schemathesis (every check on) runs against a
baked service started as a real process on the embedded default, as an operator, as a caller
without the admin role and as an anonymous caller, and must find no failure: no status code,
content type or constraint the document does not state, no schema-valid request refused. Each
request carries an ``Idempotency-Key`` of its own (``schemathesis_hooks.py`` says why)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from .support import check
from .test_smoke import _free_port

pytestmark = pytest.mark.smoke
SCHEMATHESIS = Path(sys.executable).parent / "schemathesis"
# Each request its own Idempotency-Key (why: see the hooks module).
HOOKS = Path(__file__).with_name("schemathesis_hooks.py")
# Fixed seeds: the same examples on every run (a failure is reproducible with the printed seed).
# (roles, seed, examples): the operator reaches every operation's success paths; the others
# mostly meet 401 and 403, so fewer examples say as much.
CALLERS = [("outbox-operator", 1, 25), ("clerk", 2, 10), (None, 3, 10)]


@pytest.fixture(scope="module")
def service(
    bakes: dict[str, Path], shared_python: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    project = bakes["default"]
    env = {k: v for k, v in os.environ.items() if "__" not in k}
    env["DATABASE__URL"] = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('contract') / 'service.db'}"
    check([str(shared_python), "-m", "order_service", "migrate"], project, env=env)
    port = _free_port()
    process = subprocess.Popen(
        [str(shared_python), "-m", "order_service", "run", "--port", str(port)],
        cwd=project,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"{base}/livez", timeout=2):  # noqa: S310 (loopback)
                break
        except OSError:
            assert process.poll() is None, "the service exited early"
            assert time.monotonic() < deadline, "the service never answered"
            time.sleep(0.3)
    yield base
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=30)


@pytest.mark.parametrize("caller", CALLERS, ids=["operator", "clerk", "anonymous"])
def test_the_openapi_document_says_what_the_api_does(
    service: str, bakes: dict[str, Path], shared_python: Path, caller: tuple[str | None, int, int]
) -> None:
    roles, seed, examples = caller
    command = [str(SCHEMATHESIS), "run", f"{service}/openapi.json", "--checks", "all"]
    command += ["--max-examples", str(examples), "--seed", str(seed)]
    if roles is not None:
        token = check(
            [
                str(shared_python),
                "-m",
                "order_service",
                "token",
                "--tenant",
                "acme",
                "--user",
                "u",
                "--roles",
                roles,
            ],
            bakes["default"],
        ).stdout.strip()
        command += ["-H", f"Authorization: Bearer {token}"]
        # The header goes on every request, so a case generated without the (now declared) bearer
        # header is sent with it: the anonymous run checks that a missing token is refused.
        command += ["--exclude-checks", "missing_required_header"]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": str(HOOKS)}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False, env=env)
    assert result.returncode == 0, result.stdout[-8000:]
