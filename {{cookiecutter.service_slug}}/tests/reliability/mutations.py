"""The mutation check of the reliability tier: do the scenarios catch the bugs they exist for?

``python -m tests.reliability.mutations [--only NAME] [--report PATH] [--skip-baseline] [--keep]
[--jobs N]``, run from the service root with the service's virtual environment and the services up.

Each mutation below is a known bug, written as exact text replacements in named files. For each
one, the service (everything but its virtual environment, caches and local databases) is copied
into a fresh temporary directory, the mutation is applied there, and pytest runs the mutation's
selected tests in the copy with ``PYTHONPATH=<copy>/src:<copy>/kit/src:<copy>``, so the copy's
code and kit are imported instead of the editable installs (checked before every run: a check
that imports the unmutated code would pass without testing anything). The mutation is *caught*
when a test fails; a run that cannot even collect or set up its tests is *broken* (a mutation
that breaks the import is not a caught bug), and a run that passes means the bug *survived*.
Each original snippet must occur exactly once in its file: a refactor that moves it fails this
check loudly ("no longer applies") instead of silently mutating nothing.

Before the mutations, the union of the selected tests runs on an unmutated copy and must pass
(a selection that fails anyway proves nothing). The table (mutation, what it breaks, the test
that caught it, result, seconds) is printed and written to ``--report``
(``reliability-mutations.md`` in the service root by default). The exit status is 1 when a
mutation survived, broke or no longer applies, or when the baseline failed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "src/{package}"  # the package folder, found at run time in the copy's src/
KIT = "kit/src/outbox_kit"  # the kit, vendored beside the service
DEFAULT_REPORT = "reliability-mutations.md"
RUN_TIMEOUT_SECONDS = 1200


@dataclass(frozen=True)
class Edit:
    """Replace ``original`` (which must occur exactly once) in ``path`` (relative to the service
    root; ``{package}`` is the package's name) with ``replacement``."""

    path: str
    original: str
    replacement: str


@dataclass(frozen=True)
class Mutation:
    name: str
    breaks: str
    edits: tuple[Edit, ...]
    selection: tuple[str, ...]  # pytest arguments: node ids, or "-k", EXPR / "-m", EXPR


PROCESSES = "tests/reliability/test_processes.py"
CONFORMANCE = "tests/reliability/test_conformance.py"
CRASH_GUARD = "test_a_consumer_that_crashes_on_every_delivery_is_dead_lettered_by_the_guard"

MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        name="outcome-without-token-guard",
        breaks="outcome writes (stamp, release, failure record) match the row id only, not the lock token",
        edits=(
            Edit(
                f"{KIT}/persistence/tables.py",
                "return sa.and_(self._c.id.in_(list(ids)), self._c.lock_token == token)",
                "return self._c.id.in_(list(ids))",
            ),
            Edit(
                f"{KIT}/persistence/tables.py",
                ".where(self._c.id == row_id, self._c.lock_token == token)\n            .values(**values)",
                ".where(self._c.id == row_id)\n            .values(**values)",
            ),
        ),
        # A worker frozen past its lease resumes and stamps rows another worker finished.
        selection=(
            f"{CONFORMANCE}::test_1_a_worker_frozen_past_its_lease_writes_no_outcome_when_it_resumes",
        ),
    ),
    Mutation(
        name="ack-before-inbox-commit",
        breaks="the broker message is acknowledged before the handler's transaction (inbox row) commits",
        edits=(
            Edit(
                f"{KIT}/consume/subscribers.py",
                "        try:\n            async with keep_alive(delivery):\n",
                "        await delivery.ack()\n        try:\n            async with keep_alive(delivery):\n",
            ),
            Edit(
                f"{KIT}/consume/subscribers.py",
                "reason=HANDLER_FAILED)\n            return\n        await delivery.ack()\n",
                "reason=HANDLER_FAILED)\n            return\n",
            ),
        ),
        # The handler kills its process: acknowledged early, the message is gone for good and
        # the next process never sees it (the crash guard never gets its third delivery).
        selection=(f"{PROCESSES}::{CRASH_GUARD}[rabbitmq]",),
    ),
    Mutation(
        name="claim-without-ordering-guard",
        breaks="the claim takes any free keyed row, not only the head of its key",
        edits=(
            Edit(
                f"{KIT}/processor/claim.py",
                "        .where(no_earlier)\n",
                "        .where(sa.true())\n",
            ),
        ),
        # A backing-off head has no lock token, so only this guard holds its followers back;
        # and only a window that yields a whole batch uses it (a smaller backlog goes through
        # the key scan, which finds heads anyway): hence a poison head and a 96-row backlog.
        selection=(f"{PROCESSES}::test_order_per_key_holds_under_two_processors_with_a_poison_head",),
    ),
    Mutation(
        name="inbox-without-unique-key",
        breaks="inbox_messages is created without its (message_id, consumer) primary key",
        edits=(
            Edit(
                "migrations/versions/0001_outbox_core.py",
                '        sa.PrimaryKeyConstraint("message_id", "consumer"),\n',
                "",
            ),
        ),
        # Both processes pass the inbox pre-check (a file barrier): only the key stops the second.
        selection=(f"{PROCESSES}::test_two_consumer_processes_racing_one_duplicate_give_one_effect",),
    ),
    Mutation(
        name="in-process-without-lease-renewal",
        breaks="in-process dispatch runs a row's handlers without renewing its lease first",
        edits=(
            Edit(
                f"{KIT}/processor/in_process.py",
                "            await self._leases.renew(row)\n",
                "",
            ),
        ),
        # API processes dispatch notes whose handlers outlast the lease beside a worker: without
        # the renewal, the worker claims a later note of a commit while the API runs it too.
        selection=(
            f"{CONFORMANCE}::test_2_an_api_process_killed_after_its_commit_leaves_its_events_to_the_worker",
        ),
    ),
)


class CheckError(Exception):
    """The check itself cannot run (a stale mutation, a copy that imports the wrong code)."""


@dataclass
class Outcome:
    mutation: Mutation
    result: str  # caught, survived, broken
    caught_by: str
    seconds: float
    detail: str  # the failure's message when caught, what happened otherwise


# -- the copy --------------------------------------------------------------------------------

TOP_LEVEL_SKIPPED = {".venv", "venv", ".git", "build", "dist", "htmlcov", ".tox", ".nox"}
SKIPPED_ANYWHERE = (
    "__pycache__",
    "*.pyc",
    ".pytest_cache",
    ".mypy_cache",
    ".ruff_cache",
    ".hypothesis",
    "*.egg-info",
    ".coverage",
    ".coverage.*",
    "coverage.xml",
    "*.db",
    "*.db-wal",
    "*.db-shm",
    "node_modules",
)


def ignored(directory: str, names: list[str]) -> set[str]:
    skipped = set(shutil.ignore_patterns(*SKIPPED_ANYWHERE)(directory, names))
    if Path(directory) == ROOT:
        skipped |= TOP_LEVEL_SKIPPED & set(names)
        skipped |= {name for name in names if name.startswith("reliability-") and name.endswith(".md")}
    return skipped


def copy_service(into: Path) -> Path:
    copy = into / ROOT.name
    shutil.copytree(ROOT, copy, symlinks=True, ignore=ignored)
    return copy


def package_name(root: Path) -> str:
    packages = [p.name for p in (root / "src").iterdir() if (p / "__init__.py").is_file()]
    if len(packages) != 1:
        msg = f"expected one package under {root / 'src'}, found {packages}"
        raise CheckError(msg)
    return packages[0]


def environment(copy: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONHOME"}}
    env |= {
        "PYTHONPATH": os.pathsep.join(map(str, (copy / "src", copy / "kit" / "src", copy))),
        "ALEMBIC_CONFIG": str(copy / "alembic.ini"),  # the migrations come from the copy too
        "REQUIRE_SERVICES": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "COLUMNS": "400",  # room for the failure's message on pytest's FAILED summary line
    }
    return env


def verify_imports(copy: Path) -> None:
    """The copy's package and tests must be the ones imported, not the editable install."""
    probe = "import importlib, sys\nfor n in sys.argv[1:]: print(importlib.import_module(n).__file__)"
    names = [package_name(copy), "outbox_kit", "tests"]
    done = subprocess.run(
        [sys.executable, "-c", probe, *names],
        cwd=copy,
        env=environment(copy),
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    if done.returncode != 0:
        msg = f"the copy cannot import {names}: {done.stderr.strip()[-2000:]}"
        raise CheckError(msg)
    files = done.stdout.splitlines()[-len(names) :]  # the last lines: an import may print too
    if len(files) != len(names):
        msg = f"the import probe printed {done.stdout!r}, not the files of {names}"
        raise CheckError(msg)
    for name, file in zip(names, files, strict=True):
        if not Path(file).resolve().is_relative_to(copy.resolve()):
            msg = f"{name} is imported from {file}, not from the copy {copy}: the check would test nothing"
            raise CheckError(msg)


# -- mutations -------------------------------------------------------------------------------


def resolved(edit: Edit, package: str) -> str:
    return edit.path.format(package=package)


def stale_edits(mutation: Mutation, root: Path, package: str) -> list[str]:
    """Why each edit of ``mutation`` would not apply to ``root`` (empty when all apply)."""
    problems = []
    for edit in mutation.edits:
        path = root / resolved(edit, package)
        found = path.read_text(encoding="utf-8").count(edit.original) if path.is_file() else 0
        if found != 1:
            problems.append(
                f"mutation {mutation.name} no longer applies: {resolved(edit, package)} changed "
                f"(its original snippet occurs {found} times, not once)"
            )
    return problems


def apply(mutation: Mutation, copy: Path, package: str) -> None:
    for edit in mutation.edits:
        path = copy / resolved(edit, package)
        text = path.read_text(encoding="utf-8")
        if text.count(edit.original) != 1:
            msg = f"mutation {mutation.name} no longer applies: {resolved(edit, package)} changed"
            raise CheckError(msg)
        path.write_text(text.replace(edit.original, edit.replacement), encoding="utf-8")


# -- pytest ----------------------------------------------------------------------------------


@dataclass
class Run:
    code: int
    output: str
    seconds: float

    def first(self, kind: str) -> tuple[str, str]:
        """The node id and the message of the first ``FAILED``/``ERROR`` line of the short
        summary (``-rfE``); empty strings when there is none."""
        for line in self.output.splitlines():
            if line.startswith(f"{kind} "):
                node, _, message = line[len(kind) + 1 :].partition(" - ")
                return node.strip(), message.strip()[:400]
        return "", ""

    def tail(self, lines: int = 25) -> str:
        return "\n".join(self.output.rstrip().splitlines()[-lines:])


def pytest(copy: Path, selection: Sequence[str]) -> Run:
    command = [sys.executable, "-m", "pytest", "-p", "no:randomly", "-p", "no:cacheprovider"]
    command += ["-x", "-q", "-rfE", *selection]
    started = time.monotonic()
    try:
        done = subprocess.run(
            command,
            cwd=copy,
            env=environment(copy),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            check=False,
            timeout=RUN_TIMEOUT_SECONDS,
        )
    except subprocess.TimeoutExpired as expired:
        output = expired.stdout if isinstance(expired.stdout, str) else ""
        return Run(-1, f"{output}\ntimed out after {RUN_TIMEOUT_SECONDS}s", time.monotonic() - started)
    return Run(done.returncode, done.stdout, time.monotonic() - started)


def in_copy(work: Path, label: str) -> Path:
    """A fresh copy of the service under ``work/label``, checked to import itself."""
    place = work / label
    place.mkdir()
    copy = copy_service(place)
    verify_imports(copy)
    return copy


def baseline_groups(mutations: Sequence[Mutation]) -> list[list[str]]:
    """Plain node ids run together (deduplicated); a selection with options runs on its own."""
    ids: list[str] = []
    groups: list[list[str]] = []
    for mutation in mutations:
        if any(arg.startswith("-") for arg in mutation.selection):
            groups.append(list(mutation.selection))
        else:
            ids += [arg for arg in mutation.selection if arg not in ids]
    return [ids, *groups] if ids else groups


def run_baseline(mutations: Sequence[Mutation], work: Path) -> tuple[bool, str]:
    copy = in_copy(work, "baseline")
    seconds = 0.0
    for group in baseline_groups(mutations):
        print(f"baseline: {' '.join(group)}", flush=True)
        run = pytest(copy, group)
        seconds += run.seconds
        if run.code != 0:
            return False, f"the baseline failed (exit {run.code}, {run.seconds:.0f}s):\n{run.tail(40)}"
    return True, f"the baseline passed ({seconds:.0f}s)"


def run_mutation(mutation: Mutation, work: Path) -> Outcome:
    started = time.monotonic()
    copy = in_copy(work, mutation.name)
    apply(mutation, copy, package_name(copy))
    print(f"{mutation.name}: {' '.join(mutation.selection)}", flush=True)
    run = pytest(copy, mutation.selection)
    seconds = time.monotonic() - started
    if run.code == 0:
        return Outcome(mutation, "survived", "", seconds, f"every selected test passed:\n{run.tail(5)}")
    failed, message = run.first("FAILED")
    if run.code == 1 and failed:
        return Outcome(mutation, "caught", failed, seconds, message)
    errored, _ = run.first("ERROR")
    why = f"pytest exit {run.code}" + (f", error in {errored}" if errored else "")
    return Outcome(mutation, "broken", "", seconds, f"{why} (not a failed scenario):\n{run.tail()}")


# -- the report ------------------------------------------------------------------------------


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table(outcomes: Sequence[Outcome], baseline: str) -> str:
    lines = [
        "# Reliability mutations",
        "",
        f"Baseline: {baseline}.",
        "",
        "| mutation | what it breaks | caught by | result | seconds |",
        "| --- | --- | --- | --- | ---: |",
    ]
    for o in outcomes:
        caught_by = f"`{o.caught_by}`" if o.caught_by else "-"
        lines.append(
            f"| {cell(o.mutation.name)} | {cell(o.mutation.breaks)} | {cell(caught_by)} "
            f"| {o.result} | {o.seconds:.0f} |"
        )
    caught = [o for o in outcomes if o.result == "caught"]
    if caught:
        lines += ["", "How each was caught (the first failure's message):", ""]
        lines += [f"* {o.mutation.name}: {o.detail or '(no message)'}" for o in caught]
    for o in outcomes:
        if o.result != "caught":
            lines += ["", f"## {o.mutation.name}: {o.result}", "", "```", o.detail, "```"]
    return "\n".join(lines) + "\n"


def publish(text: str, report: Path) -> None:
    print(text, flush=True)
    report.write_text(text, encoding="utf-8")
    print(f"written to {report}", flush=True)


# -- main ------------------------------------------------------------------------------------


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.reliability.mutations", description=__doc__)
    names = [m.name for m in MUTATIONS]
    parser.add_argument("--only", action="append", choices=names, metavar="NAME", help=", ".join(names))
    parser.add_argument("--report", type=Path, default=ROOT / DEFAULT_REPORT)
    parser.add_argument("--skip-baseline", action="store_true", help="skip the unmutated run (iterating)")
    parser.add_argument("--keep", action="store_true", help="leave the copies in the temporary directory")
    parser.add_argument("--jobs", type=int, default=1, metavar="N", help="mutations run at once (default 1)")
    return parser.parse_args(argv)


def reported(outcome: Outcome) -> Outcome:
    name = outcome.mutation.name
    print(f"{name}: {outcome.result} {outcome.caught_by} ({outcome.seconds:.0f}s)", flush=True)
    return outcome


def check(args: argparse.Namespace, work: Path) -> int:
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    package = package_name(ROOT)
    stale = [problem for m in chosen for problem in stale_edits(m, ROOT, package)]
    if stale:
        print("\n".join(stale), file=sys.stderr, flush=True)
        return 1
    baseline = "skipped (--skip-baseline)"
    if not args.skip_baseline:
        passed, baseline = run_baseline(chosen, work)
        if not passed:
            publish(table([], baseline), args.report)
            return 1
    # Each mutation runs in its own copy, test database and broker namespace, so several can
    # run at once; most of a scenario's time is spent waiting for leases, restarts and timeouts.
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        outcomes = list(pool.map(lambda mutation: reported(run_mutation(mutation, work)), chosen))
    publish(table(outcomes, baseline), args.report)
    return 0 if all(o.result == "caught" for o in outcomes) else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    work = Path(tempfile.mkdtemp(prefix="reliability-mutations-"))
    try:
        return check(args, work)
    except CheckError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 1
    finally:
        if args.keep:
            print(f"copies kept in {work}", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
