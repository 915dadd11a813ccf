"""Outbox and inbox enablement at start-up: refused combinations, warnings, and the processors that run."""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from outbox_kit.runtime.diagnostics import startup_diagnostics
from outbox_kit.runtime.settings import DEV_JWT_SECRET
from outbox_kit.testing.fixtures import (
    free_port,
    get,
    kit_container,
    make_settings,
    service_argv,
    service_process,
    wait_for,
)

pytestmark = pytest.mark.integration


def run_cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if "__" not in k}
    return subprocess.run(
        [*service_argv(), *args],
        env=clean | {"DATABASE__URL": "sqlite+aiosqlite:///:memory:"} | env,  # nothing on disk
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_broker_with_the_outbox_explicitly_off_refuses_to_start() -> None:
    result = run_cli("worker", MESSAGE_BUS__TRANSPORT="rabbitmq", MESSAGE_BUS__ENABLE_OUTBOX="false")
    assert result.returncode == 2
    assert "ENABLE_OUTBOX=false is refused with the rabbitmq transport" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_shortened_lease_alone_starts_the_worker(sqlite_url: str) -> None:
    """``OUTBOX__LEASE_SECONDS=5`` and nothing else: the time limits follow the lease, and the
    worker starts (it was refused, twice over, for limits nobody had set)."""
    port = free_port()
    with service_process(sqlite_url, "worker", OUTBOX__LEASE_SECONDS="5", WORKER__PORT=str(port)) as process:
        wait_for(f"http://127.0.0.1:{port}/livez", process)
        assert get(f"http://127.0.0.1:{port}/livez")[0] == 200


def test_explicit_time_limit_contradictions_are_one_configuration_error() -> None:
    """Two limits that contradict the delivery's: both named at once, on one line, exit 2."""
    result = run_cli(
        "worker",
        OUTBOX__LEASE_SECONDS="5",
        OUTBOX__DELIVERY_TIMEOUT_SECONDS="3",
        MESSAGE_BUS__PUBLISH_TIMEOUT_SECONDS="3",
        MESSAGE_BUS__HANDLER_TIMEOUT_SECONDS="4",
    )
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: configuration error: ")
    assert "MESSAGE_BUS__PUBLISH_TIMEOUT_SECONDS (3) must be below" in line
    assert "MESSAGE_BUS__HANDLER_TIMEOUT_SECONDS (4) must be below" in line


def test_production_refuses_dev_tokens() -> None:
    result = run_cli(
        "token",
        "--tenant",
        "t",
        "--user",
        "u",
        ENVIRONMENT="production",
        AUTH__JWT_SECRET="x" * 40,
        AUTH__JWT_ISSUER="https://id.example",
        AUTH__JWT_AUDIENCE="order-service",
    )
    assert result.returncode == 2
    assert "refused in production" in result.stderr


@pytest.mark.parametrize(
    ("arguments", "env"),
    [
        (["api", "--host", "0.0.0.0"], {}),  # noqa: S104 (the address being refused)
        (["run", "--host", "::"], {}),
        (["api"], {"API__HOST": "0.0.0.0"}),  # noqa: S104
    ],
)
def test_the_published_jwt_secret_is_never_served_beyond_loopback(
    tmp_path: Path, arguments: list[str], env: dict[str, str]
) -> None:
    """Anyone who read the template knows the default secret and could mint an admin token:
    with it, `run` and `api` listen on loopback only (one line, exit 2, nothing started)."""
    clean = {k: v for k, v in os.environ.items() if "__" not in k}
    result = subprocess.run(
        [*service_argv(), *arguments, "--port", "0"],
        env=clean
        | env
        | {"AUTH__JWT_SECRET": DEV_JWT_SECRET, "DATABASE__URL": f"sqlite+aiosqlite:///{tmp_path / 'x.db'}"},
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: AUTH__JWT_SECRET is the published development default")
    assert "loopback" in line


@pytest.mark.parametrize("algorithm", ["none", "RS256", "hs256"])
def test_production_refuses_a_jwt_algorithm_it_cannot_verify_at_start_up(
    tmp_path: Path, algorithm: str
) -> None:
    """With ``none`` (or any algorithm that is not HMAC) the service started and refused every
    token. It now refuses to start: one line, exit 2, nothing served."""
    clean = {k: v for k, v in os.environ.items() if "__" not in k}
    env = clean | {
        "ENVIRONMENT": "production",
        "AUTH__JWT_SECRET": "s" * 64,
        "AUTH__JWT_ISSUER": "https://id.example",
        "AUTH__JWT_AUDIENCE": "order-service",
        "AUTH__JWT_ALGORITHM": algorithm,
        "DATABASE__URL": f"sqlite+aiosqlite:///{tmp_path / 'x.db'}",
    }
    process = subprocess.Popen(
        [*service_argv(), "api", "--port", "0"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _, stderr = process.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        pytest.fail(f"the service started with AUTH__JWT_ALGORITHM={algorithm}")
    assert process.returncode == 2, stderr
    (line,) = stderr.strip().splitlines()
    assert "auth.jwt_algorithm" in line
    assert "HS256, HS384 or HS512" in line


def test_the_inbox_off_with_a_broker_warns_once(sqlite_url: str, caplog: pytest.LogCaptureFixture) -> None:
    settings = make_settings(sqlite_url, message_bus={"transport": "rabbitmq", "enable_inbox": False})
    with caplog.at_level(logging.WARNING):
        startup_diagnostics(kit_container(settings))
    assert caplog.text.count("MESSAGE_BUS__ENABLE_INBOX=false") == 1


@pytest.mark.parametrize(
    ("bus", "warning"),
    [
        ({"signing_keys": {}, "signing_key_id": ""}, "No MESSAGE_BUS__SIGNING_KEYS"),
        ({"allow_unsigned": True}, "MESSAGE_BUS__ALLOW_UNSIGNED=true"),
        ({}, None),
    ],
)
def test_accepting_unsigned_messages_on_a_broker_warns(
    sqlite_url: str, caplog: pytest.LogCaptureFixture, bus: dict[str, Any], warning: str | None
) -> None:
    settings = make_settings(sqlite_url, message_bus={"transport": "redis", **bus})
    with caplog.at_level(logging.WARNING):
        startup_diagnostics(kit_container(settings))
    unsigned = [r.getMessage() for r in caplog.records if "unsigned" in r.getMessage()]
    assert [warning in message for message in unsigned] == ([] if warning is None else [True])


def test_a_composition_root_that_bypasses_the_outbox_is_reported(
    sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    container = kit_container(make_settings(sqlite_url))
    container.units_of_work().outbox_enabled = False  # a later wiring "overrode" the outbox
    with caplog.at_level(logging.WARNING):
        startup_diagnostics(container)
    assert "events would bypass it" in caplog.text


@pytest.mark.parametrize(
    ("bus", "expected"),
    [
        ({"enable_outbox": True}, ["outbox", "internal_commands"]),
        ({"enable_outbox": False}, ["internal_commands"]),
    ],
)
def test_the_worker_runs_the_outbox_processor_only_when_the_outbox_is_on(
    sqlite_url: str, bus: dict[str, bool], expected: list[str]
) -> None:
    container = kit_container(make_settings(sqlite_url, message_bus=bus))
    assert [source.name for source in container.sources()] == expected


@pytest.mark.parametrize(
    ("outbox", "inbox_days", "warns"),
    [
        ({}, None, False),  # the defaults keep the invariant: 14 days of inbox > 7 of dead letters
        ({"dead_letter_retention_days": 30}, 14, True),
        ({"retention_days": 10}, 10, True),  # dead letters fall back to RETENTION_DAYS
        ({"retention_days": 0}, 14, True),  # dead letters are never purged
        ({"retention_days": 0}, 0, False),  # and neither is the inbox: nothing turns stale
    ],
)
def test_an_inbox_that_forgets_before_a_dead_letter_can_be_replayed_warns(
    sqlite_url: str,
    caplog: pytest.LogCaptureFixture,
    outbox: dict[str, Any],
    inbox_days: int | None,
    warns: bool,
) -> None:
    """A consumer refuses (as stale) a message older than its inbox remembers. A dead letter of
    this service replayed late in its retention window would reach its own consumers stale, so
    the inbox must outlive the dead letters."""
    inbox = {} if inbox_days is None else {"retention_days": inbox_days}
    settings = make_settings(sqlite_url, outbox=outbox, inbox=inbox)
    with caplog.at_level(logging.WARNING):
        startup_diagnostics(kit_container(settings))
    assert ("INBOX__RETENTION_DAYS" in caplog.text) is warns
