"""`python -m <package> worker` and `api` as real processes on the embedded default (SQLite):
the worker delivers what the API process committed, and both stop cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from outbox_kit.runtime.container import build_tokens
from outbox_kit.testing.fixtures import free_port, make_settings

pytestmark = pytest.mark.integration
PROJECT = Path(__file__).resolve().parents[2]
ORDER = {"customer_id": "c-1", "lines": [{"sku": "BOOK", "quantity": 1, "unit_price": "5.00"}]}


def start(command: str, url: str, *args: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if "__" not in k} | {
        "DATABASE__URL": url,
        "MESSAGE_BUS__ENABLE_OUTBOX": "true",
        "MESSAGE_BUS__ENABLE_INBOX": "true",
        "OUTBOX__POLLING_INTERVAL_SECONDS": "0.5",
        # The API process only writes: the worker process must be the one that delivers.
        "OUTBOX__IMMEDIATE_DISPATCH": "false",
        # The project's .env holds a secret of its own: sign and verify with the test's.
        "AUTH__JWT_SECRET": make_settings(url).auth.jwt_secret.get_secret_value(),
    }
    return subprocess.Popen(
        [sys.executable, "-m", "{{ cookiecutter.package_name }}", command, *args],
        cwd=PROJECT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def stop(process: subprocess.Popen[str]) -> tuple[int, str]:
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=30)
    return process.returncode, stderr


async def test_the_worker_delivers_what_the_api_process_committed(sqlite_url: str) -> None:
    port = free_port()
    api = start("api", sqlite_url, "--port", str(port))
    worker = start("worker", sqlite_url)
    headers = {
        "Authorization": f"Bearer {build_tokens(make_settings(sqlite_url)).mint(user_id='u', tenant_id='t')}"
    }
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            for _ in range(300):
                try:
                    if (await client.get("/readyz")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.1)
            order = (await client.post("/orders", json=ORDER, headers=headers)).json()
            found: list[dict[str, str]] = []
            for _ in range(300):
                found = (await client.get(f"/notifications?order_id={order['id']}", headers=headers)).json()
                if found:
                    break
                await asyncio.sleep(0.1)
    finally:
        api_code, api_log = stop(api)
        worker_code, worker_log = stop(worker)
    ours = [n["event_name"] for n in found if n["event_name"].startswith("orders.")]  # not a later context's
    assert ours == ["orders.order-placed.v1"]
    assert (api_code, worker_code) == (0, 0), api_log[-2000:] + worker_log[-2000:]
    assert "worker stopped" in worker_log
    engine = sa.create_engine(sqlite_url.replace("+aiosqlite", ""))
    with engine.connect() as connection:
        # The orders context's rows (a context added later may write rows of its own for the order).
        rows = connection.execute(
            sa.text("SELECT locked_by, processed_on FROM outbox_messages WHERE event_name LIKE 'orders.%'")
        ).all()
    engine.dispose()
    assert len(rows) == 2  # the domain event and the integration event it was translated into
    assert {locked_by for locked_by, _ in rows} == {f"{socket.gethostname()}:{worker.pid}"}
    assert all(processed_on is not None for _, processed_on in rows)
