"""Producer-only hosts, the LISTEN connection's reconnect, the outbox CLI, and what the
processor does when the database fails while it records an outcome."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from outbox_kit.persistence.tables import (
    OUTBOX_TABLE,
)
from outbox_kit.persistence.writer import WakeSignal, notify_channel
from outbox_kit.processor.processor import PostgresListener
from outbox_kit.runtime.cli import CliError, reload_on_change
from outbox_kit.runtime.container import OutboxContainer, build_listeners
from outbox_kit.runtime.settings import Environment
from outbox_kit.testing.fixtures import (
    acting_as,
    eventually,
    fetch,
    free_port,
    service_argv,
    service_env,
    service_process,
    wait_for,
)
from outbox_kit.testing.harness import (
    Counter,
    Counters,
    Created,
    FakeClock,
    ScriptedDeliverer,
    insert_rows,
    install_kit,
    outbox_source,
    row,
    state,
    tcp_proxy,
)
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

pytestmark = pytest.mark.integration


async def test_a_producer_only_host_persists_without_dispatching(make_container: Any) -> None:
    producer = make_container(outbox={"immediate_dispatch": False})
    kit = await install_kit(producer)
    kit.on(Created, kit.recording("producer-side"))
    with acting_as():
        async with producer.units_of_work()() as uow:
            uow.repository(Counters).add(Counter.create("acme"))
            await uow.commit()
    (written,) = await fetch(producer, sa.select(OUTBOX_TABLE))
    assert kit.seen == []  # nothing ran on the producer
    assert (written.lock_token, written.processed_on) == (None, None)  # the processor's from the start
    delay = written.available_on - written.occurred_on
    assert delay < timedelta(seconds=1)  # eligible at once: there is no in-process attempt to wait for
    await outbox_source(producer, producer.outbox_deliverer()).run_cycle()  # the processor host delivers
    assert [label for label, _ in kit.seen] == ["producer-side"]
    assert (await state(producer, written.id)).processed_on is not None


async def test_a_database_failure_while_recording_an_outcome_is_not_charged(
    container: OutboxContainer,
) -> None:
    clock = FakeClock()
    (row_id,) = await insert_rows(container, [row("kit.a.v1", clock.now)])
    source = outbox_source(container, ScriptedDeliverer(), clock, lease_seconds=30)

    async def database_down(*_args: Any, **_kwargs: Any) -> Any:
        raise OperationalError("UPDATE", {}, Exception("connection refused"))

    source.leases.stamp_processed = database_down  # type: ignore[method-assign]
    with pytest.raises(OperationalError):
        await source.run_cycle()  # fails the cycle (the polling loop logs it and waits)
    after = await state(container, row_id)
    assert (after.retry_count, after.last_error, after.processed_on) == (0, None, None)
    clock.advance(31)  # once the lease ends, the row is delivered again
    again = outbox_source(container, ScriptedDeliverer(), clock)
    await again.run_cycle()
    assert (await state(container, row_id)).processed_on is not None


@pytest.mark.postgres
async def test_the_listener_reconnects_and_catches_up(postgres_url: str, make_container: Any) -> None:
    container = make_container(database={"url": postgres_url})
    wake = WakeSignal()
    event = wake.subscribe()
    (listener,) = build_listeners(container.settings(), container.data_sources(), wake)
    task = asyncio.create_task(listener.run())
    try:
        await asyncio.wait_for(listener.connected.wait(), 10)
        event.clear()
        async with container.database().session() as session:
            await session.exec(
                sa.text(  # type: ignore[call-overload]
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE query LIKE 'LISTEN%' AND datname = current_database()"
                )
            )
        await asyncio.wait_for(event.wait(), 10)  # the catch-up wake after the reconnect
        await asyncio.wait_for(listener.connected.wait(), 10)
        event.clear()
        before = listener.notifications
        with acting_as():
            async with container.units_of_work()() as uow:
                await install_kit(container)
                from outbox_kit.testing.harness import CounterChangedV1

                uow.enqueue(CounterChangedV1(counter_id="c", value=1))
                await uow.commit()
        await asyncio.wait_for(event.wait(), 10)
        assert listener.notifications > before
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.mark.postgres
async def test_the_listener_detects_a_half_open_connection_and_comes_back(
    postgres_url: str, make_container: Any
) -> None:
    """The line to PostgreSQL goes silent without closing: the keepalive ``SELECT 1`` times out,
    the listener drops the connection, retries until the line is back, and listens again."""
    container = make_container(database={"url": postgres_url})
    url = make_url(postgres_url)
    channel = notify_channel(container.settings().application.namespace)
    wake = WakeSignal()
    async with tcp_proxy(url.host or "127.0.0.1", url.port or 5432) as proxy:
        dsn = url.set(drivername="postgresql", host="127.0.0.1", port=proxy.port)
        listener = PostgresListener(
            dsn.render_as_string(hide_password=False),
            channel,
            wake,
            keepalive_seconds=0.3,
            query_timeout_seconds=0.5,
            max_backoff=0.5,
        )
        task = asyncio.create_task(listener.run())
        try:
            await asyncio.wait_for(listener.connected.wait(), 10)
            proxy.freeze()
            await eventually(lambda: not listener.connected.is_set())  # found out, not hanging
            proxy.thaw()
            await asyncio.wait_for(listener.connected.wait(), 10)
            assert listener.connections >= 2
            before = listener.notifications
            async with container.database().session() as session:
                await session.exec(sa.text(f'NOTIFY "{channel}"'))  # type: ignore[call-overload]
                await session.commit()
            await eventually(lambda: listener.notifications > before)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


class DroppingConnection:
    """An asyncpg connection that the server drops as soon as LISTEN is asked for."""

    def is_closed(self) -> bool:
        return False

    def add_termination_listener(self, callback: object) -> None:
        del callback

    async def add_listener(self, channel: str, callback: object) -> None:
        del channel, callback
        raise ConnectionResetError(104, "Connection reset by peer")

    async def close(self, timeout: float) -> None:
        del timeout
        raise ConnectionResetError(104, "already gone")  # closing a dead connection fails too

    def terminate(self) -> None:
        return None


async def test_a_server_that_drops_every_connection_is_retried_at_the_backoff_pace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Connecting works, listening fails at once: the backoff still grows (a reset would only
    follow a connection that stayed up), and a failing close does not end the listener."""
    import asyncpg

    attempts: list[float] = []

    async def connect(dsn: str, timeout: float) -> DroppingConnection:
        del dsn, timeout
        attempts.append(time.monotonic())
        return DroppingConnection()

    monkeypatch.setattr(asyncpg, "connect", connect)
    listener = PostgresListener("postgresql://nowhere/db", "channel", WakeSignal(), max_backoff=0.2)
    task = asyncio.create_task(listener.run())
    await asyncio.sleep(1.0)
    assert not task.done()  # still trying
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    gaps = [later - earlier for earlier, later in itertools.pairwise(attempts)]
    assert 3 <= len(attempts) <= 9  # 0.05, 0.1, 0.2, 0.2...: not a tight loop
    assert all(gap >= 0.04 for gap in gaps)


def cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if "__" not in k} | {"DATABASE__URL": url}
    return subprocess.run(
        [*service_argv(), "outbox", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def test_the_outbox_cli_lists_explains_and_replays(container: OutboxContainer) -> None:
    now = container.clock()()
    (dead,) = await insert_rows(
        container,
        [
            row(
                "kit.a.v1",
                now,
                dead_lettered_on=now,
                dead_letter_reason="retries_exhausted",
                retry_count=5,
                last_error="boom",
            ),
        ],
    )
    await insert_rows(container, [row("kit.a.v1", now)])
    url = container.settings().database.url
    pending = await asyncio.to_thread(cli, url, "pending")
    expected = {"source": "outbox", "pending": 1, "leased": 0, "dead_lettered": 1}
    assert json.loads(pending.stdout)[0] == expected
    letters = json.loads((await asyncio.to_thread(cli, url, "dead-letters")).stdout)
    assert [d["id"] for d in letters] == [str(dead)]
    explained = json.loads((await asyncio.to_thread(cli, url, "explain", str(dead))).stdout)
    assert explained["state"] == "dead_lettered"
    replayed = json.loads((await asyncio.to_thread(cli, url, "replay", "--actor", "ops", str(dead))).stdout)
    assert (replayed["replayed"], replayed["replayed_by"]) == ([str(dead)], "ops")
    again = await asyncio.to_thread(cli, url, "replay", "--actor", "ops", str(dead))
    assert again.returncode == 2, again.stderr
    assert again.stderr.strip().splitlines() == [
        f"error: nothing to replay: not dead-lettered (already replayed?): {dead}"
    ]
    unknown = await asyncio.to_thread(cli, url, "explain", str(uuid.uuid4()))
    assert unknown.returncode == 2
    assert "no outbox row has id" in unknown.stderr
    assert "Traceback" not in unknown.stderr


async def test_the_outbox_cli_refuses_an_offset_past_any_page_in_one_line(container: OutboxContainer) -> None:
    url = container.settings().database.url
    answer = await asyncio.to_thread(cli, url, "dead-letters", "--offset", str(2**63))
    assert answer.returncode == 2, answer.stderr
    assert "Traceback" not in answer.stderr
    (line,) = answer.stderr.strip().splitlines()
    assert line.startswith("error: offset must be between 0 and 10000")


def test_reload_is_refused_in_production(container: OutboxContainer) -> None:
    """Production images never reload: `--reload` there is one clear line, not a watcher."""
    production = container.settings().model_copy(update={"environment": Environment.PRODUCTION})
    with pytest.raises(CliError, match="refused in production"):
        reload_on_change(production, lambda settings: container)


# A service whose project folder is not the working directory: the kit's own service on the
# project folder given, as a generated service's __main__ gives its own.
TOKEN_COMMAND = (
    "import sys; from pathlib import Path; from outbox_kit.runtime import cli; "
    "from outbox_kit.runtime.settings import ServiceSettings; "
    "from outbox_kit.testing.processes import harness_service; "
    "cli.main(ServiceSettings, harness_service, project=Path(sys.argv[1]), argv=sys.argv[2:])"
)
OWN_SECRET = "the-service-own-secret-of-at-least-32-bytes"


def mint_elsewhere(project: Path, cwd: Path, database_url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", TOKEN_COMMAND, str(project), "token", "--tenant", "acme", "--user", "alice"],
        cwd=cwd,
        env=service_env(database_url),
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )


def test_token_reads_the_services_own_settings_from_any_folder(tmp_path: Path, sqlite_url: str) -> None:
    """``TOKEN=$(... token ...)`` pasted in another folder than the service's: the token is
    signed with the service's own secret and stamped with its issuer and audience (from the
    service's .env), so the running server accepts it; stderr says what was stamped, stdout
    holds the token alone."""
    project, elsewhere = tmp_path / "service", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    issuer, audience = "https://id.example", "orders"
    (project / ".env").write_text(
        f"AUTH__JWT_SECRET={OWN_SECRET}\nAUTH__JWT_ISSUER={issuer}\nAUTH__JWT_AUDIENCE={audience}\n"
    )
    minted = mint_elsewhere(project, elsewhere, sqlite_url)
    assert minted.returncode == 0, minted.stderr
    token = minted.stdout.strip()
    assert "\n" not in token
    assert str(project / ".env") in minted.stderr
    assert f"issuer {issuer}; audience {audience}" in minted.stderr
    assert OWN_SECRET not in minted.stderr

    port = free_port()
    server_settings = {
        "AUTH__JWT_SECRET": OWN_SECRET,
        "AUTH__JWT_ISSUER": issuer,
        "AUTH__JWT_AUDIENCE": audience,
        "API__PORT": str(port),
    }
    with service_process(sqlite_url, "api", **server_settings) as server:
        wait_for(f"http://127.0.0.1:{port}/livez", server)
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/admin/outbox/pending", headers={"Authorization": f"Bearer {token}"}
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:  # noqa: S310 (loopback)
                status = answer.status
        except urllib.error.HTTPError as error:
            status, detail = error.code, error.read().decode()
        else:
            detail = ""
    assert status == 403, detail  # accepted as alice (403: she holds no admin role), not 401


def test_token_refuses_the_built_in_secret_while_a_dotenv_here_names_another(
    tmp_path: Path, sqlite_url: str
) -> None:
    """The service's settings name no secret, but the working directory's .env does: a token
    signed with the built-in secret would surprise whoever pasted it, so nothing is printed."""
    project, elsewhere = tmp_path / "service", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    (project / ".env").write_text("ENVIRONMENT=development\n")  # the service's: no secret of its own
    (elsewhere / ".env").write_text(f"AUTH__JWT_SECRET={OWN_SECRET}\n")
    minted = mint_elsewhere(project, elsewhere, sqlite_url)
    assert minted.returncode == 2, minted.stdout
    assert "built-in development secret" in minted.stderr
    assert minted.stdout == ""
