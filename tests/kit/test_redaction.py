"""Credentials in URLs are masked wherever the service logs or shows a URL."""

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from outbox_kit.application.text import mask_credentials
from outbox_kit.runtime import cli, server
from outbox_kit.runtime.settings import ServiceSettings
from outbox_kit.testing.fixtures import kit_container

pytestmark = pytest.mark.unit
DATABASE = "postgresql+asyncpg://app:s3cret-pw@db.internal:5432/app"


@pytest.mark.parametrize(
    ("text", "masked"),
    [
        (DATABASE, "postgresql+asyncpg://app:***@db.internal:5432/app"),
        ("amqp://guest:guest@rabbit:5672/", "amqp://guest:***@rabbit:5672/"),
        ("redis://:token@cache:6379/0", "redis://:***@cache:6379/0"),
        ("postgresql://u:p@ss:w@db/x", "postgresql://u:***@db/x"),  # '@' and ':' in the password
        (
            "tried nats://a:b@n1:4222 then kafka://c:d@k1:9092, gave up",
            "tried nats://a:***@n1:4222 then kafka://c:***@k1:9092, gave up",
        ),
    ],
)
def test_passwords_in_urls_are_masked(text: str, masked: str) -> None:
    assert mask_credentials(text) == masked


@pytest.mark.parametrize(
    "text",
    [
        "sqlite+aiosqlite:///./service.db",
        "postgresql://nobody@db/x",  # a user name alone is not a secret
        "mail alice@example.com about http://example.com/a:b@c",
        "ratio 3:2 at noon",
    ],
)
def test_text_without_url_credentials_is_unchanged(text: str) -> None:
    assert mask_credentials(text) == text


def test_the_development_banner_masks_the_database_password(capsys: pytest.CaptureFixture[str]) -> None:
    settings = ServiceSettings(_env_file=None, database={"url": DATABASE})  # type: ignore[call-arg]
    server.print_banner(kit_container(settings), "http://127.0.0.1:8000", with_worker=True)
    banner = capsys.readouterr().err
    assert "s3cret-pw" not in banner
    assert "postgresql+asyncpg://app:***@db.internal:5432/app" in banner


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def connect() -> None:
    raise ConnectionError(f"refused by {DATABASE}")


@pytest.mark.usefixtures("restore_logging")
def test_every_log_line_of_a_command_masks_url_passwords(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``run`` sets up the process's logging for every command; any logger's line with a URL,
    the message and its traceback, reaches the output masked."""
    monkeypatch.setenv("LOGGING__JSON_FORMAT", "false")
    command = ["token", "--tenant", "t", "--user", "u"]
    assert cli.run(ServiceSettings, kit_container, project=Path(), argv=command) == 0
    log = logging.getLogger("some.library")
    log.warning("cannot connect to %s", DATABASE)
    try:
        connect()
    except ConnectionError:
        log.exception("listener lost its connection")
    output = capsys.readouterr().err
    assert "cannot connect to postgresql+asyncpg://app:***@db.internal:5432/app" in output
    assert "ConnectionError: refused by postgresql+asyncpg://app:***@db" in output
    assert "s3cret-pw" not in output
