"""A service that is working logs no ERROR and no traceback: FastStream's records that report
nothing wrong are kept out, every other one goes through."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

import pytest
from outbox_kit.transports.base import BROKER_LOG, FastStreamNoise

pytestmark = pytest.mark.unit

# The shape of nats-py's JetStream pull: a deadline passed with nothing fetched.
NATS_CLIENT = """
import asyncio

async def _fetch_n(batch, timeout):
    raise asyncio.TimeoutError

async def fetch(batch=1, timeout=5):
    return await _fetch_n(batch, timeout)
"""


def raised_in(filename: str, error: type[BaseException] = TimeoutError) -> BaseException:
    """The error a coroutine compiled as ``filename`` raises, with its real traceback."""
    scope: dict[str, object] = {}
    exec(compile(NATS_CLIENT.replace("asyncio.TimeoutError", error.__name__), filename, "exec"), scope)  # noqa: S102
    try:
        asyncio.run(scope["fetch"]())  # type: ignore[operator]
    except BaseException as caught:
        return caught
    raise AssertionError


def supervisor_record(
    error: BaseException | None, message: str = "Task-9 raised an exception, retrying..."
) -> logging.LogRecord:
    exc_info = (type(error), error, error.__traceback__) if error else None
    return BROKER_LOG.makeRecord(BROKER_LOG.name, logging.ERROR, __file__, 1, message, (), exc_info)


NATS_PATH = str(Path(sys.prefix) / "lib" / "site-packages" / "nats" / "js" / "client.py")


def test_an_idle_nats_pull_is_not_an_error_but_every_other_failure_is() -> None:
    noise = FastStreamNoise()
    assert noise.filter(supervisor_record(raised_in(NATS_PATH))) is False
    assert noise.filter(supervisor_record(raised_in(NATS_PATH, ValueError))) is True
    assert noise.filter(supervisor_record(raised_in("/srv/app/handlers.py"))) is True
    assert noise.filter(supervisor_record(None, "consumer crashed")) is True
    assert noise.filter(supervisor_record(None, "callback for Task-8 is being executed...")) is False


def test_the_filter_guards_the_broker_log_every_transport_writes_to(caplog: pytest.LogCaptureFixture) -> None:
    assert any(isinstance(f, FastStreamNoise) for f in BROKER_LOG.filters)
    with caplog.at_level(logging.INFO, logger=BROKER_LOG.name):
        BROKER_LOG.handle(supervisor_record(raised_in(NATS_PATH)))
        BROKER_LOG.handle(supervisor_record(raised_in(NATS_PATH, ValueError)))
    assert [r.exc_info[0] for r in caplog.records if r.exc_info] == [ValueError]
