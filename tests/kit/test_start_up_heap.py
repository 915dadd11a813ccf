"""A service process freezes its start-up heap once started (``outbox_kit.runtime.heap``), so the
collector's full collections no longer stop it for a tenth of a second every few seconds; objects
made afterwards are collected as before, and an app in a test leaves the test runner alone."""

from __future__ import annotations

import gc
import subprocess
import threading
import weakref

import pytest
from outbox_kit.runtime.heap import freeze_start_up_heap
from outbox_kit.testing.fixtures import free_port, service_process

FROZEN = "start-up heap frozen: "


class Node:
    """An object that can take part in a reference cycle."""

    other: Node | None = None


@pytest.mark.unit
def test_the_start_up_heap_is_frozen_and_what_comes_later_is_still_collected() -> None:
    try:
        frozen = freeze_start_up_heap()
        assert frozen == gc.get_freeze_count() > 1000  # the test runner's modules, at the least
        first, second = Node(), Node()
        first.other, second.other = second, first  # a cycle: only the collector frees it
        gone = weakref.ref(first)
        del first, second
        gc.collect()
        assert gone() is None
    finally:
        gc.unfreeze()


def logged(process: subprocess.Popen[str], text: str, timeout: float = 60) -> str:
    """The first line of ``process``'s log holding ``text`` (killed and failed after ``timeout``)."""
    seen: list[str] = []
    watchdog = threading.Timer(timeout, process.kill)
    watchdog.start()
    try:
        assert process.stderr is not None
        for line in process.stderr:
            seen.append(line)
            if text in line:
                return line
    finally:
        watchdog.cancel()
    msg = f"never logged {text!r} (exit {process.poll()}):\n{''.join(seen)}"
    raise AssertionError(msg)


@pytest.mark.integration
@pytest.mark.postgres
@pytest.mark.parametrize(
    "arguments",
    [
        pytest.param(["worker"], id="worker"),
        pytest.param(["worker", "--port", "PORT"], id="worker-with-probes"),
        pytest.param(["api", "--port", "PORT"], id="api"),
    ],
)
def test_every_service_process_freezes_its_heap_once_started(postgres_url: str, arguments: list[str]) -> None:
    port = str(free_port())
    with service_process(postgres_url, *(port if a == "PORT" else a for a in arguments)) as process:
        line = logged(process, FROZEN)
    count = int(line.split(FROZEN)[1].split()[0])
    assert count > 10_000  # the modules, the settings, the container: the process's start-up
