"""What every benchmark scenario shares: targets, bench events, row writing, child processes.

* :class:`Target` is one database + one transport + one namespace. ``settings()`` builds the
  service's own :class:`Settings` for it (outbox and inbox on, signed headers, logging at
  WARNING) and ``env()`` gives the same configuration to a child process as environment
  variables (``SECTION__KEY``), so the parent and its children always agree.
* :class:`BenchTicked` (keyless) and :class:`BenchKeyed` (``ordered=True``: its ``aggregate_id``
  is the ordering key) carry ``sent_at`` (``time.time()`` when the event was made, for latency)
  and a filler, so a published body is about 250 bytes.
* :func:`write_events` commits rows through the real unit of work, 200 events per commit, under
  a request context (tenant, user, correlation), exactly as a command handler would.
* :class:`Child` runs ``python -m bench.actor <role>`` and talks to it one line at a time
  (``ready``, ``go``, ``count``, ``done``, ``stats``). With ``BENCH_PROFILE_DIR`` set, every
  worker child is sampled by ``py-spy record --format raw`` into that folder.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import sqlalchemy as sa
from outbox_kit.application.context import (
    RequestContext,
    use_context,
)
from outbox_kit.application.messages import (
    IntegrationEvent,
)
from outbox_kit.persistence.tables import (
    COMMAND_TABLE,
    OUTBOX_TABLE,
    InboxMessage,
)
from sqlalchemy.ext.asyncio import create_async_engine

from {{ cookiecutter.package_name }}.container import (
    Container,
    build_container,
)
from {{ cookiecutter.package_name }}.settings import (
    Settings,
)

BENCH_ROOT = Path(__file__).resolve().parent.parent
URLS = {
    "rabbitmq": "amqp://guest:guest@127.0.0.1:5672/",
    "nats": "nats://127.0.0.1:4222",
    "redis": "redis://127.0.0.1:6379",
}
DEFAULT_DATABASE = os.environ.get("DATABASE__URL") or "postgresql+asyncpg://postgres@127.0.0.1:5432/bench"
COUNTER = "bench.counter"  # the consumer name the counting child (or the real consumer) uses
PER_COMMIT = 200
FILLER = "bench-" + "x" * 114  # 120 characters: with the ids and times, a ~250-byte body
PROFILE_ENV = "BENCH_PROFILE_DIR"
BENCH_CONTEXT = RequestContext(tenant_id="bench", user_id="bench", correlation_id="bench")
# The tables every scenario empties first (the relay's own, and the inbox the consumer fills).
RELAY_TABLES = (OUTBOX_TABLE.name, COMMAND_TABLE.name, InboxMessage.__tablename__)


class BenchTicked(IntegrationEvent, name="bench.ticked.v1"):
    """A keyless bench event."""

    number: int
    sent_at: float
    filler: str = FILLER


class BenchKeyed(IntegrationEvent, name="bench.keyed.v1", ordered=True):
    """A bench event ordered by its ``aggregate_id`` (the ordering key)."""

    number: int
    sent_at: float
    filler: str = FILLER


EVENT_TYPES: dict[str, type[BenchTicked | BenchKeyed]] = {"ticked": BenchTicked, "keyed": BenchKeyed}


def ticked(number: int) -> BenchTicked:
    return BenchTicked(number=number, sent_at=time.time())


def keyed(number: int, keys: int) -> BenchKeyed:
    return BenchKeyed(number=number, sent_at=time.time(), aggregate_id=f"key-{number % keys}")


def make_events(count: int, *, keys: int = 0) -> list[BenchTicked | BenchKeyed]:
    """``count`` events; with ``keys`` they cycle over that many ordering keys."""
    return [keyed(n, keys) if keys else ticked(n) for n in range(count)]


def _nested(overrides: dict[str, str]) -> dict[str, dict[str, Any]]:
    """``{"OUTBOX__BATCH_SIZE": "100"}`` -> ``{"outbox": {"batch_size": "100"}}``."""
    sections: dict[str, dict[str, Any]] = {}
    for key, value in overrides.items():
        section, _, name = key.lower().partition("__")
        sections.setdefault(section, {})[name] = value
    return sections


@dataclass(frozen=True)
class Target:
    """One database, one transport and one namespace (fresh per scenario: fresh queues)."""

    database: str
    transport: str = "rabbitmq"
    url: str = URLS["rabbitmq"]
    namespace: str = "bench"
    # Environment-style settings (``OUTBOX__BATCH_SIZE=100``) applied to parent and children.
    overrides: dict[str, str] = field(default_factory=dict)

    def fresh(self, **changes: Any) -> Target:  # noqa: ANN401 (dataclasses.replace's values)
        """A copy with a new namespace (so new queues/streams) and ``changes`` applied."""
        return replace(self, namespace=f"bench{uuid.uuid4().hex[:8]}", **changes)

    def base_sections(self) -> dict[str, dict[str, Any]]:
        return {
            "application": {"namespace": self.namespace},
            "database": {"url": self.database},
            "message_bus": {
                "transport": self.transport,
                "url": self.url,
                "enable_outbox": True,
                "enable_inbox": True,
                "signing_keys": "bench:bench-secret",
                "signing_key_id": "bench",
            },
            "logging": {"level": "WARNING"},
        }

    def settings(self, **sections: dict[str, Any]) -> Settings:
        """The service's settings for this target; ``sections`` override single keys."""
        merged = self.base_sections()
        for extra in (_nested(self.overrides), sections):
            for name, values in extra.items():
                merged[name] = merged.get(name, {}) | values
        build: Any = Settings  # sections as keyword arguments: mypy cannot type them
        return cast("Settings", build(_env_file=None, **merged))  # no .env file

    def env(self, **sections: dict[str, Any]) -> dict[str, str]:
        """The same configuration as environment variables for a child process."""
        merged = self.base_sections()
        for name, values in sections.items():
            merged[name] = merged.get(name, {}) | values
        env = {k: v for k, v in os.environ.items() if "__" not in k}  # no stray service settings
        for name, values in merged.items():
            for key, value in values.items():
                env[f"{name}__{key}".upper()] = str(value).lower() if isinstance(value, bool) else str(value)
        env.update(self.overrides)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BENCH_ROOT), env.get("PYTHONPATH", "")]))
        return env


def bench_container(settings: Settings) -> Container:
    """The service's container with the bench events registered."""
    container = build_container(settings)
    container.registry().register(BenchTicked, BenchKeyed)
    return container


async def write_events(
    container: Container, events: Sequence[IntegrationEvent], per_commit: int = PER_COMMIT
) -> None:
    """Commit ``events`` as outbox rows through the real unit of work, ``per_commit`` at a time."""
    units = container.units_of_work()
    with use_context(BENCH_CONTEXT):
        for first in range(0, len(events), per_commit):
            async with units() as uow:
                for event in events[first : first + per_commit]:
                    uow.enqueue(event)
                await uow.commit()


async def execute(url: str, *statements: str, autocommit: bool = False) -> list[Any]:
    """Run raw SQL statements on ``url``; the first column of each statement's first row."""
    engine = create_async_engine(url, isolation_level="AUTOCOMMIT" if autocommit else None)
    answers: list[Any] = []
    try:
        async with engine.begin() as connection:
            for statement in statements:
                result = await connection.execute(sa.text(statement))
                answers.append(result.scalar() if result.returns_rows else None)
    finally:
        await engine.dispose()
    return answers


async def empty_outbox(url: str) -> None:
    """Empty the relay's tables (outbox, internal commands, inbox) on the bench database."""
    await execute(url, f"TRUNCATE {', '.join(RELAY_TABLES)}")


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100, nearest rank); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def median(values: Iterable[float]) -> float:
    kept = sorted(v for v in values if v == v)  # noqa: PLR0124 (drops NaN)
    if not kept:
        return float("nan")
    middle = len(kept) // 2
    return kept[middle] if len(kept) % 2 else (kept[middle - 1] + kept[middle]) / 2


class ChildError(RuntimeError):
    """A child process ended or timed out before saying what was expected."""


_profiles = {"count": 0, "warned": False}


class Child:
    """``python -m bench.actor <role> ...`` with a line protocol on stdin/stdout."""

    def __init__(self, role: str, args: Sequence[str], env: dict[str, str]) -> None:
        self.role = role
        self._args = list(args)
        self._env = env
        self._process: asyncio.subprocess.Process | None = None
        self._lines: asyncio.Queue[str | None] = asyncio.Queue()
        self._reader: asyncio.Task[None] | None = None
        self._profiler: asyncio.subprocess.Process | None = None
        self.lines: list[str] = []  # every line the child printed

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def process(self) -> asyncio.subprocess.Process:
        if self._process is None:
            msg = f"{self.role}: not started"
            raise ChildError(msg)
        return self._process

    async def start(self) -> Child:
        self._process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "bench.actor",
            self.role,
            *self._args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=self._env,
            cwd=BENCH_ROOT,
        )
        self._reader = asyncio.create_task(self._read())
        if self.role == "worker":
            await self._attach_profiler()
        return self

    async def _read(self) -> None:
        stdout = self.process.stdout
        assert stdout is not None  # noqa: S101 (created with a pipe)
        while line := await stdout.readline():
            text = line.decode().strip()
            self.lines.append(text)
            await self._lines.put(text)
        await self._lines.put(None)

    async def _attach_profiler(self) -> None:
        folder = os.environ.get(PROFILE_ENV)
        if not folder:
            return
        py_spy = shutil.which("py-spy")
        if py_spy is None:
            if not _profiles["warned"]:
                print(f"{PROFILE_ENV} is set but py-spy is not installed (pip install py-spy): no profile")
                _profiles["warned"] = True
            return
        await asyncio.to_thread(Path(folder).mkdir, parents=True, exist_ok=True)
        _profiles["count"] += 1
        output = Path(folder) / f"{self.role}-{_profiles['count']}.txt"
        self._profiler = await asyncio.create_subprocess_exec(
            py_spy,
            *("record", "--format", "raw", "--rate", "250", "--nonblocking"),
            *("--pid", str(self.pid), "-o", str(output)),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )

    async def expect(self, prefix: str, timeout: float) -> str:  # noqa: ASYNC109 (explicit deadline)
        """Wait for a line starting with ``prefix``; return the rest of it."""
        try:
            async with asyncio.timeout(timeout):
                while True:
                    line = await self._lines.get()
                    if line is None:
                        code = await self.process.wait()
                        msg = f"{self.role} exited ({code}) before printing {prefix!r}"
                        raise ChildError(msg)
                    if line == prefix or line.startswith(prefix + " "):
                        return line[len(prefix) :].strip()
        except TimeoutError:
            msg = f"{self.role} did not print {prefix!r} within {timeout:.0f} s"
            raise ChildError(msg) from None

    async def send(self, line: str) -> None:
        stdin = self.process.stdin
        assert stdin is not None  # noqa: S101 (created with a pipe)
        stdin.write(line.encode() + b"\n")
        await stdin.drain()

    async def stop(self, grace: float = 10.0) -> list[str]:
        """Close stdin (the child's cue to stop), SIGTERM after ``grace``; all lines printed."""
        if self._process is None:
            return self.lines
        process = self._process
        if process.stdin is not None and not process.stdin.is_closing():
            process.stdin.close()
        try:
            await asyncio.wait_for(process.wait(), grace)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), grace)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
        if self._reader is not None:
            await asyncio.wait_for(self._reader, 10)
        if self._profiler is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._profiler.wait(), 30)
        return self.lines

    def last(self, prefix: str) -> str | None:
        """The rest of the last line printed starting with ``prefix`` (after ``stop``)."""
        for line in reversed(self.lines):
            if line.startswith(prefix + " "):
                return line[len(prefix) :].strip()
        return None
