"""Tier 3, generated suite: a baked service installs into its own virtual environment and its
own test suite passes (default broker, Kafka, and without the example context); its migrations
are consistent. The default bake runs on the newest supported Python (the template's own
interpreter is the floor).

The broker answer changes no Python file but ``about.py`` (the render tier proves it), so running
the whole suite in both bakes would test the same code twice (six minutes of CI). The default
bake runs every tier but the slow and Kafka ones; the ``broker=kafka`` bake runs its fast Kafka
tier (marker ``kafka``, against ``TEST_KAFKA_URL``), which also proves it installs and imports as
generated; the slow tier of the default bake runs the Kafka reliability scenarios too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .support import REQUIRE_SERVICES, bake, check, find_python, install

pytestmark = [pytest.mark.generated, pytest.mark.long]


def _service_env() -> dict[str, str]:
    return {"REQUIRE_SERVICES": "1"} if REQUIRE_SERVICES else {}


NEWEST_PYTHON = "3.13"  # the newest answer python_version accepts (hooks/validation.py)


def newest_python() -> str:
    """The newest supported Python, on which the default bake runs every tier: a service's CI
    runs its floor and each newer supported Python, and the machine's default one is the floor,
    which alone once hid a hang on 3.12.1+. Required in CI; elsewhere said and replaced."""
    found = find_python(NEWEST_PYTHON)
    if found is None:
        if REQUIRE_SERVICES:
            pytest.fail(f"Python {NEWEST_PYTHON} was not found (PATH, pyenv, uv): CI must prove it")
        print(f"Python {NEWEST_PYTHON} not found: the default bake runs on {sys.version.split()[0]}")
        return sys.executable
    return found


@pytest.fixture(scope="module")
def default_service(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The default bake, installed once on the newest supported Python for its fast and its slow
    tiers: (project, python)."""
    project = bake(tmp_path_factory.mktemp("default"))
    return project, install(project, newest_python())


PYTEST = ("-m", "pytest", "-q", "-p", "no:cacheprovider")
# The example-free bake's tiers: the broker- and PostgreSQL-backed tests use the test kit, not
# the example, so the default bake runs them on the same code.
WITHOUT_EXAMPLE_TIERS = "not slow and not kafka and not rabbitmq and not nats and not redis and not postgres"


def run_at_once(suites: dict[str, tuple[Path, Path, list[str]]], logs: Path) -> None:
    """Run each suite's pytest (``root, python, arguments``) at the same time; fail naming every
    suite that failed, with the end of its output."""
    running = {}
    for name, (root, interpreter, arguments) in suites.items():
        log = (logs / f"{name}.log").open("w")
        command = [str(interpreter), *PYTEST, *arguments]
        environment = {**os.environ, **_service_env()}
        started = subprocess.Popen(command, cwd=root, env=environment, stdout=log, stderr=subprocess.STDOUT)
        running[name] = (started, log)
    failed = []
    for name, (started, log) in running.items():
        code = started.wait(timeout=1500)
        log.close()
        output = (logs / f"{name}.log").read_text()
        print(f"--- {name} ---\n{output[-3000:]}")  # what ran and what was skipped, and why
        if code != 0:
            failed.append(f"{name} suite failed ({code}):\n{output[-6000:]}")
    assert failed == [], "\n".join(failed)


def test_generated_test_suites_pass_default_kafka_and_without_example(
    default_service: tuple[Path, Path], tmp_path: Path
) -> None:
    """The default bake's fast tiers, the Kafka bake's Kafka tier and the example-free bake's
    suite on SQLite, run at the same time: the Kafka tier spends most of its time waiting for
    consumer-group joins, so the two CPU-bound suites share the machine's two cores with it."""
    project, python = default_service
    kafka_project = bake(tmp_path / "kafka", broker="kafka")
    bare_project = bake(tmp_path / "bare", include_example=False)
    run_at_once(
        {
            # Two workers, as `make test` runs it (pytest-xdist): the tiers stay isolated per worker.
            "default": (project, python, ["-m", "not slow and not kafka", "-n", "2"]),
            "kafka": (kafka_project, install(kafka_project), ["-m", "kafka and not slow"]),
            "without-example": (bare_project, install(bare_project), ["-m", WITHOUT_EXAMPLE_TIERS]),
        },
        tmp_path,
    )
    # Without the example its migrations chain differs: on PostgreSQL too.
    migrations = [str(bare_project / ".venv/bin/python"), *PYTEST, "tests/integration/test_migrations.py"]
    check(migrations, bare_project, env=_service_env(), timeout=600)


# The slow tier in three parts of about the same length, which the template's workers run side
# by side: each part its own pytest session (its own database; a broker namespace per scenario).
# Together they select every slow test once: the last part is what the others leave.
SLOW_PARTS = {
    "rabbitmq": "rabbitmq",
    "kafka-nats": "(kafka or nats) and not rabbitmq",
    "redis-and-unparametrized": "not (rabbitmq or kafka or nats)",
}


@pytest.mark.parametrize("part", SLOW_PARTS)
def test_generated_slow_tier_passes(default_service: tuple[Path, Path], part: str) -> None:
    """The reliability and slow tiers (several real processes) of the default bake."""
    project, python = default_service
    selection = ["-m", "slow", "-k", SLOW_PARTS[part]]
    result = check([str(python), *PYTEST, *selection], project, env=_service_env(), timeout=1800)
    print(result.stdout[-4000:])  # the reliability summary table


def test_generated_mutation_check_catches_the_known_bugs(default_service: tuple[Path, Path]) -> None:
    """The default bake's mutation check: each known bug, applied to a copy, fails a reliability
    scenario. No baseline run: the slow tier runs in the same session on the same code."""
    project, _ = default_service
    if not REQUIRE_SERVICES:
        pytest.skip("the mutation check needs every service: REQUIRE_SERVICES=1 (CI) runs it")
    # Two at a time (own copies, databases and namespaces).
    mutation_args = "MUTATION_ARGS=--skip-baseline --jobs 2"
    mutations = check(["make", "test-mutations", mutation_args], project, timeout=1500)
    print(mutations.stdout[-3000:])
