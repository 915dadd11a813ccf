"""``python -m bench`` (``make bench ARGS='...'``): the relay against the raw broker, in one run.

Every figure is measured in this run against the configured PostgreSQL and broker and compared
with the targets of the performance issue. Ratios are taken A B A B: in each of ``--rounds``
rounds the reference (raw publish, outbox off, keyless, ...) and the measured variant run back
to back, the ratio is taken within the round, and the table shows the median and the range of
the rounds with the absolute medians next to it. Nothing is asserted: the machine is shared and
noisy, read the range before the median.

Sections (``--only drain,e2e,...``):

* ``drain``: N rows relayed by 1 and by 2 worker processes to a raw counting consumer, against
  FastStream publishing the same N relay-shaped messages 64 in flight (and the same on NATS
  JetStream unless ``--no-nats``);
* ``e2e``: the same with the real consume pipeline (signature, inbox, handler) as the consumer;
* ``write``: commits/s of a one-row command with the outbox on against off, 1 and 8 writers;
* ``latency``: commit to consumer handler at a steady 200 events/s, worker in this process
  (in-process wake) and in another process (NOTIFY wake);
* ``backlog``: the relay's claim + stamp throughput with 10k, 100k and 1M pending rows, and the
  worker's maximum resident memory while draining the smallest and the largest backlog;
* ``ordered``: relay drain of N rows over 100 ordering keys against keyless, 1 and 2 workers;
* ``idle``: statements per second of one worker at default settings on an empty outbox.

``--set OUTBOX__BATCH_SIZE=100`` (repeatable) applies a service setting to every process;
``BENCH_PROFILE_DIR=folder`` records a py-spy profile of every worker child (if py-spy is
installed). Results go to ``--json`` and ``--markdown`` (the table of docs/performance.md).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import os
import platform
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from . import scenarios
from .common import DEFAULT_DATABASE, URLS, Target, empty_outbox, median
from .scenarios import Outcome

SECTIONS = ("drain", "e2e", "write", "latency", "backlog", "ordered", "idle")
NAN = float("nan")


@dataclass
class Figure:
    """One line of the table: per-round values against a target."""

    section: str
    label: str
    unit: str  # "x" (a ratio), "ms", "MB" or "stmt/s"
    target: tuple[str, float] | None  # (">=" or "<=", threshold)
    values: list[float] = field(default_factory=list)
    absolute: str = ""
    errors: list[str] = field(default_factory=list)

    @property
    def median(self) -> float:
        return median(self.values)

    @property
    def kept(self) -> list[float]:
        return [v for v in self.values if v == v]  # noqa: PLR0124 (drops NaN)

    @property
    def met(self) -> bool | None:
        value = self.median
        if self.target is None or value != value:  # noqa: PLR0124 (NaN: not measured)
            return None
        op, threshold = self.target
        return value >= threshold if op == ">=" else value <= threshold

    def fmt(self, value: float) -> str:
        if value != value:  # noqa: PLR0124 (NaN)
            return "n/a"
        return f"{value:.2f}x" if self.unit == "x" else f"{value:.1f} {self.unit}"

    def row(self) -> list[str]:
        kept = self.kept
        spread = f"{self.fmt(min(kept))} - {self.fmt(max(kept))}" if len(kept) > 1 else ""
        target = f"{self.target[0]} {self.fmt(self.target[1])}" if self.target else "(info)"
        result = {True: "met", False: "NOT met", None: "" if self.target is None else "not measured"}
        return [self.label, target, self.fmt(self.median), spread, self.absolute, result[self.met]]

    def as_json(self) -> dict[str, Any]:
        return {
            "section": self.section,
            "label": self.label,
            "unit": self.unit,
            "target": list(self.target) if self.target else None,
            "median": None if self.median != self.median else round(self.median, 4),
            "values": [None if v != v else round(v, 4) for v in self.values],  # noqa: PLR0124
            "absolute": self.absolute,
            "met": self.met,
            "errors": self.errors,
        }


class Run:
    """The figures and every raw outcome of one benchmark run."""

    def __init__(self, args: argparse.Namespace, target: Target) -> None:
        self.args = args
        self.target = target
        self.figures: list[Figure] = []
        self.raw: dict[str, list[dict[str, Any]]] = {}

    def figure(self, section: str, label: str, unit: str, target: tuple[str, float] | None = None) -> Figure:
        made = Figure(section, label, unit, target)
        self.figures.append(made)
        return made

    async def measure(
        self, section: str, name: str, round_: int, step: Callable[[], Awaitable[Outcome]]
    ) -> Outcome | None:
        """Run one measurement, log it, keep its raw numbers; None (and the error) on failure."""
        print(f"[{section}] round {round_}: {name} ...", end=" ", flush=True)
        try:
            outcome = await step()
        except Exception as error:  # noqa: BLE001 (one failed figure must not stop the run)
            print(f"FAILED: {type(error).__name__}: {error}")
            if self.args.verbose:
                traceback.print_exc()
            self.raw.setdefault(section, []).append({"round": round_, "name": name, "error": str(error)})
            return None
        print(json.dumps(_brief(outcome.as_json())))
        self.raw.setdefault(section, []).append({"round": round_, "name": name} | outcome.as_json())
        return outcome


def _brief(values: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if k != "workers"}


def ratio(a: Outcome | None, b: Outcome | None) -> float:
    return a.rate / b.rate if a is not None and b is not None and b.rate > 0 else NAN


def rate_of(outcomes: list[Outcome | None]) -> float:
    return median(o.rate if o is not None else NAN for o in outcomes)


def extra_of(outcomes: list[Outcome | None], key: str) -> list[float]:
    return [float(o.extra.get(key, NAN)) if o is not None else NAN for o in outcomes]


# -- sections -----------------------------------------------------------------------------------


async def drain(run: Run) -> None:
    n, target = run.args.messages, run.target
    one = run.figure("drain", "Relay drain, 1 worker / raw publish", "x", (">=", 0.8))
    two = run.figure("drain", "Relay drain, 2 workers / raw publish", "x", (">=", 1.0))
    raws, ones, twos = [], [], []
    for r in range(1, run.args.rounds + 1):
        raw = await run.measure("drain", "raw publish", r, lambda: scenarios.raw_publish(target, n))
        w1 = await run.measure("drain", "relay 1 worker", r, lambda: scenarios.relay_drain(target, n))
        w2 = await run.measure(
            "drain", "relay 2 workers", r, lambda: scenarios.relay_drain(target, n, processes=2)
        )
        one.values.append(ratio(w1, raw))
        two.values.append(ratio(w2, raw))
        raws.append(raw)
        ones.append(w1)
        twos.append(w2)
    one.absolute = f"{rate_of(ones):.0f} vs {rate_of(raws):.0f} msg/s"
    two.absolute = f"{rate_of(twos):.0f} vs {rate_of(raws):.0f} msg/s"
    if run.args.no_nats or target.transport == "nats":
        return
    nats = Target(target.database, "nats", URLS["nats"], overrides=target.overrides)
    figure = run.figure("drain", "NATS JetStream drain, 1 worker / raw publish", "x", (">=", 0.7))
    raws, ones = [], []
    for r in range(1, run.args.rounds + 1):
        raw = await run.measure("drain", "NATS raw publish", r, lambda: scenarios.raw_publish(nats, n))
        w1 = await run.measure("drain", "NATS relay 1 worker", r, lambda: scenarios.relay_drain(nats, n))
        figure.values.append(ratio(w1, raw))
        raws.append(raw)
        ones.append(w1)
    figure.absolute = f"{rate_of(ones):.0f} vs {rate_of(raws):.0f} msg/s"


async def e2e(run: Run) -> None:
    n, target = run.args.messages, run.target
    figure = run.figure("e2e", "End to end (consume pipeline, inbox) / raw publish", "x", (">=", 0.5))
    raws, relays = [], []
    for r in range(1, run.args.rounds + 1):
        raw = await run.measure("e2e", "raw publish", r, lambda: scenarios.raw_publish(target, n))
        relay = await run.measure(
            "e2e", "relay + consume pipeline", r, lambda: scenarios.relay_drain(target, n, pipeline=True)
        )
        figure.values.append(ratio(relay, raw))
        raws.append(raw)
        relays.append(relay)
    figure.absolute = f"{rate_of(relays):.0f} vs {rate_of(raws):.0f} msg/s"


async def write(run: Run) -> None:
    target, seconds = run.target, run.args.write_seconds
    for writers, goal in ((1, (">=", 0.75)), (8, None)):
        figure = run.figure("write", f"Write, outbox on / off, {writers} writer(s)", "x", goal)
        ons, offs = [], []
        for r in range(1, run.args.rounds + 1):

            def step(*, on: bool, w: int = writers) -> Callable[[], Awaitable[Outcome]]:
                return lambda: scenarios.commit_rate(target, writers=w, outbox_on=on, seconds=seconds)

            on = await run.measure("write", f"outbox on, {writers} writer(s)", r, step(on=True))
            off = await run.measure("write", f"outbox off, {writers} writer(s)", r, step(on=False))
            figure.values.append(ratio(on, off))
            ons.append(on)
            offs.append(off)
        figure.absolute = f"{rate_of(ons):.0f} vs {rate_of(offs):.0f} commits/s"


async def latency(run: Run) -> None:
    target, rate, seconds = run.target, run.args.latency_rate, run.args.latency_seconds
    goals = {True: (5.0, 25.0), False: (15.0, 60.0)}
    for in_process in (True, False):
        where = "in-process worker" if in_process else "worker in another process"
        p50, p99 = goals[in_process]
        f50 = run.figure("latency", f"Latency p50 at {rate}/s, {where}", "ms", ("<=", p50))
        f99 = run.figure("latency", f"Latency p99 at {rate}/s, {where}", "ms", ("<=", p99))
        outcomes = []
        for r in range(1, run.args.rounds + 1):

            def step(inside: bool = in_process) -> Awaitable[Outcome]:
                return scenarios.latency(target, in_process=inside, per_second=rate, seconds=seconds)

            outcomes.append(await run.measure("latency", where, r, step))
        f50.values = extra_of(outcomes, "p50_ms")
        f99.values = extra_of(outcomes, "p99_ms")
        # The writer may fall behind the asked rate on a loaded machine: say what it reached.
        f50.absolute = f99.absolute = f"{int(rate * seconds)} events, written at {rate_of(outcomes):.0f}/s"


async def backlog(run: Run) -> None:
    sizes = sorted(run.args.backlogs)
    rows = min(run.args.claim_rows, sizes[0] // 2)
    claims: dict[int, list[Outcome | None]] = {}
    memory: dict[int, Outcome | None] = {}
    for size in sizes:
        target = run.target.fresh()
        print(f"[backlog] filling {size} pending rows ...", flush=True)
        started = time.monotonic()
        try:
            await scenarios.fill_backlog(target, size)
        except Exception as error:  # noqa: BLE001 (reported, the run goes on)
            print(f"[backlog] fill failed: {type(error).__name__}: {error}")
            continue
        print(f"[backlog] filled in {time.monotonic() - started:.1f} s", flush=True)
        claim = functools.partial(scenarios.claim_rate, target, rows)
        claims[size] = [
            await run.measure("backlog", f"claim {rows} rows of {size}", r, claim)
            for r in range(1, run.args.rounds + 1)
        ]
        if size in {sizes[0], sizes[-1]}:
            drained = functools.partial(scenarios.drain_memory, target, size, run.args.drain_seconds)
            name = f"worker draining {size} for {run.args.drain_seconds:.0f} s"
            memory[size] = await run.measure("backlog", name, 1, drained)
        await empty_outbox(target.database)
    small, large = sizes[0], sizes[-1]
    figure = run.figure("backlog", f"Claim throughput, {large:,} / {small:,} pending", "x", (">=", 0.9))
    figure.values = [
        ratio(b, a) for a, b in zip(claims.get(small, []), claims.get(large, []), strict=False)
    ] or [NAN]
    figure.absolute = ", ".join(f"{size:,}: {rate_of(found):.0f} rows/s" for size, found in claims.items())
    rss = run.figure("backlog", f"Worker memory growth, {small:,} to {large:,} pending", "MB", ("<=", 50.0))
    low, high = memory.get(small), memory.get(large)
    if low is not None and high is not None:
        rss.values = [float(high.extra["max_rss_mb"]) - float(low.extra["max_rss_mb"])]
        rss.absolute = f"max RSS {low.extra['max_rss_mb']} -> {high.extra['max_rss_mb']} MB"
    else:
        rss.values = [NAN]


async def ordered(run: Run) -> None:
    n, target = run.args.messages, run.target
    keyed_ratio = run.figure("ordered", "Ordered drain, 100 keys / keyless, 1 worker", "x", (">=", 0.5))
    scaling = run.figure("ordered", "Ordered drain, 100 keys, 2 workers / 1 worker", "x", (">=", 1.3))
    keyless, ones, twos = [], [], []
    for r in range(1, run.args.rounds + 1):
        a = await run.measure("ordered", "keyless 1 worker", r, lambda: scenarios.relay_drain(target, n))
        b = await run.measure(
            "ordered", "100 keys 1 worker", r, lambda: scenarios.relay_drain(target, n, keyed=True)
        )
        c = await run.measure(
            "ordered",
            "100 keys 2 workers",
            r,
            lambda: scenarios.relay_drain(target, n, keyed=True, processes=2),
        )
        keyed_ratio.values.append(ratio(b, a))
        scaling.values.append(ratio(c, b))
        keyless.append(a)
        ones.append(b)
        twos.append(c)
    keyed_ratio.absolute = f"{rate_of(ones):.0f} vs {rate_of(keyless):.0f} msg/s"
    scaling.absolute = f"{rate_of(twos):.0f} vs {rate_of(ones):.0f} msg/s"
    disorder = sum(int(o.extra.get("out_of_order", 0)) for o in ones + twos if o is not None)
    if disorder:
        print(f"[ordered] WARNING: {disorder} keyed messages arrived behind a later one of their key")


async def idle(run: Run) -> None:
    figure = run.figure(
        "idle", "Idle statements per second, 1 worker, default settings", "stmt/s", ("<=", 1.0)
    )
    outcome = await run.measure(
        "idle", "idle worker", 1, lambda: scenarios.idle_statements(run.target, seconds=run.args.idle_seconds)
    )
    figure.values = [outcome.rate if outcome is not None else NAN]
    if outcome is not None:
        figure.absolute = f"{outcome.count} statements in {outcome.seconds:.0f} s"


RUNNERS: dict[str, Callable[[Run], Awaitable[None]]] = {
    "drain": drain,
    "e2e": e2e,
    "write": write,
    "latency": latency,
    "backlog": backlog,
    "ordered": ordered,
    "idle": idle,
}

# -- report -------------------------------------------------------------------------------------

HEADER = ["Figure", "Target", "Median", "Range", "Absolute (medians)", "Result"]


def without_password(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


async def machine(run: Run) -> dict[str, Any]:
    try:
        version = await scenarios.server_version(run.target)
    except Exception as error:  # noqa: BLE001 (informative only)
        version = f"unknown ({error})"
    return {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "postgresql": version,
        "transport": run.target.transport,
        "broker": without_password(run.target.url),
        "database": without_password(run.target.database),
    }


def settings_used(target: Target) -> dict[str, Any]:
    settings = target.settings()
    return {
        "outbox": settings.outbox.model_dump(mode="json"),
        "database_pool_size": settings.database.pool_size,
        "publish_timeout_seconds": settings.message_bus.publish_timeout_seconds,
        "overrides": target.overrides,
    }


def table(figures: list[Figure]) -> list[list[str]]:
    return [HEADER, *(figure.row() for figure in figures)]


def print_table(figures: list[Figure]) -> None:
    rows = table(figures)
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER))]
    for index, row in enumerate(rows):
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
        if index == 0:
            print("  ".join("-" * width for width in widths))


def markdown(run: Run, info: dict[str, Any], when: str) -> str:
    outbox = settings_used(run.target)["outbox"]
    lines = [
        (
            f"Measured {when} on {info['platform']} ({info['cpu_count']} CPUs), Python {info['python']}, "
            f"PostgreSQL {info['postgresql']}, transport {info['transport']}."
        ),
        (
            f"Settings: batch size {outbox['batch_size']}, delivery concurrency "
            f"{outbox['delivery_concurrency']}, polling interval {outbox['polling_interval_seconds']} s"
            + (f", overrides {run.target.overrides}" if run.target.overrides else "")
            + f"; {run.args.messages:,} messages per drain, {run.args.rounds} round(s), median (range)."
        ),
        "",
    ]
    rows = table(run.figures)
    lines.append("| " + " | ".join(rows[0]) + " |")
    lines.append("|" + "|".join("---" for _ in rows[0]) + "|")
    lines.extend("| " + " | ".join(cell or " " for cell in row) + " |" for row in rows[1:])
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench", description=(__doc__ or "").splitlines()[0], epilog="see bench/__main__.py"
    )
    parser.add_argument("--database", default=DEFAULT_DATABASE, help="PostgreSQL URL (asyncpg)")
    parser.add_argument("--transport", default="rabbitmq", choices=["rabbitmq", "nats", "redis"])
    parser.add_argument("--broker-url", default="", help="the transport's URL (its local default if empty)")
    parser.add_argument("--no-nats", action="store_true", help="skip the NATS figures of the drain")
    parser.add_argument("--messages", type=int, default=20_000, help="rows per drain")
    parser.add_argument("--rounds", type=int, default=3, help="A B A B repetitions")
    parser.add_argument(
        "--backlogs",
        type=lambda text: [int(size) for size in text.split(",")],
        default=[10_000, 100_000, 1_000_000],
        help="pending rows for the backlog section (comma-separated)",
    )
    parser.add_argument("--claim-rows", type=int, default=20_000, help="rows claimed per backlog round")
    parser.add_argument("--drain-seconds", type=float, default=20.0, help="backlog drain time for RSS")
    parser.add_argument("--write-seconds", type=float, default=5.0, help="time per commit-rate figure")
    parser.add_argument("--latency-rate", type=int, default=200, help="events per second")
    parser.add_argument("--latency-seconds", type=float, default=10.0, help="time per latency figure")
    parser.add_argument("--idle-seconds", type=float, default=30.0, help="idle sampling time")
    parser.add_argument(
        "--only",
        type=lambda text: [s.strip() for s in text.split(",") if s.strip()],
        default=list(SECTIONS),
        help=f"sections to run, comma-separated: {','.join(SECTIONS)}",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION__KEY=VALUE",
        help="a service setting for every process, e.g. OUTBOX__BATCH_SIZE=100 (repeatable)",
    )
    parser.add_argument("--json", default="bench-results.json", help="results file ('' for none)")
    parser.add_argument("--markdown", default="bench-results.md", help="table file ('' for none)")
    parser.add_argument("--verbose", action="store_true", help="print tracebacks of failed figures")
    args = parser.parse_args(argv)
    unknown = [s for s in args.only if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    bad = [o for o in args.overrides if "=" not in o or "__" not in o.partition("=")[0]]
    if bad:
        parser.error(f"--set takes SECTION__KEY=VALUE, not {', '.join(bad)}")
    return args


async def measure(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    overrides = {o.partition("=")[0].upper(): o.partition("=")[2] for o in args.overrides}
    target = Target(
        args.database, args.transport, args.broker_url or URLS[args.transport], overrides=overrides
    )
    run = Run(args, target)
    when = datetime.now(UTC).isoformat(timespec="seconds")
    await scenarios.prepare(target)
    info = await machine(run)
    print(f"bench: {info['platform']}, {info['cpu_count']} CPUs, PostgreSQL {info['postgresql']}")
    print(f"bench: {target.transport} at {without_password(target.url)}, database {info['database']}")
    for section in SECTIONS:
        if section in args.only:
            await RUNNERS[section](run)
    print()
    print_table(run.figures)
    report = {
        "when": when,
        "machine": info,
        "settings": settings_used(target),
        "arguments": {k: v for k, v in vars(args).items() if k not in {"json", "markdown", "verbose"}},
        "figures": [figure.as_json() for figure in run.figures],
        "rounds": run.raw,
    }
    return report, markdown(run, info, when)


def main() -> int:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    for name in ("faststream", "faststream.access"):  # the in-process worker's subscriber notes
        logging.getLogger(name).setLevel(logging.WARNING)
    report, table_text = asyncio.run(measure(args))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        print(f"\nresults: {args.json}")
    if args.markdown:
        Path(args.markdown).write_text(table_text, encoding="utf-8")
        print(f"table: {args.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
