"""Tier 1, render: the ecosystem files of a generated service are valid, and say what they must.

The workflow and the Dependabot file are checked against their published JSON schemas
(check-jsonschema's copies, offline), the Dockerfile with hadolint, and the pre-commit
configuration is not only validated but run: every hook passes on a fresh service."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import yaml

from .conftest import VARIANTS
from .support import BIN, TOOLS_ENV, check, find_python

pytestmark = pytest.mark.render
PYTHONS = ("3.11", "3.12", "3.13")


def answers(variant: str) -> dict[str, object]:
    return {"broker": "rabbitmq", "python_version": "3.11", **VARIANTS[variant]}


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_workflow_tests_every_supported_python_builds_the_image_and_has_its_broker(
    bakes: dict[str, Path], variant: str
) -> None:
    project = bakes[variant]
    workflow_path = project / ".github/workflows/ci.yml"
    schema = ["--builtin-schema", "vendor.github-workflows"]
    check([str(BIN / "check-jsonschema"), *schema, str(workflow_path)], project)
    workflow = yaml.safe_load(workflow_path.read_text())
    floor = str(answers(variant)["python_version"])
    test = workflow["jobs"]["test"]
    assert test["strategy"]["matrix"]["python"] == [v for v in PYTHONS if v >= floor]
    runs = "\n".join(step.get("run", "") for step in test["steps"])
    assert "test -f uv.lock ||" in runs  # a lock that was never committed fails, not re-made
    assert "make install PYTHON=python${{ matrix.python }}" in runs
    assert "make coverage" in runs
    kafka = answers(variant)["broker"] == "kafka"
    assert ("kafka" in test["services"]) is kafka
    if kafka:
        assert test["env"]["TEST_KAFKA_URL"] == "127.0.0.1:9092"
    else:  # no broker to test against: deselected, never skipped (CI fails on a missing service)
        assert test["env"]["PYTEST_ARGS"] == '-m "not kafka"'
    image = " ".join(step.get("run", "") for step in workflow["jobs"]["image"]["steps"])
    assert "docker build" in image
    assert ".State.Health.Status" in image  # waits for the HEALTHCHECK to pass


@pytest.mark.parametrize("variant", VARIANTS)
def test_dependabot_updates_python_actions_and_docker(bakes: dict[str, Path], variant: str) -> None:
    path = bakes[variant] / ".github/dependabot.yml"
    check([str(BIN / "check-jsonschema"), "--builtin-schema", "vendor.dependabot", str(path)], bakes[variant])
    ecosystems = {update["package-ecosystem"] for update in yaml.safe_load(path.read_text())["updates"]}
    assert ecosystems == {"uv", "github-actions", "docker"}


@pytest.mark.parametrize("variant", ["default", "long-name-py313"])
def test_the_dockerfile_is_multi_stage_locked_non_root_and_health_checked(
    bakes: dict[str, Path], variant: str
) -> None:
    project = bakes[variant]
    check([str(BIN / "hadolint"), "Dockerfile"], project)
    dockerfile = (project / "Dockerfile").read_text()
    stages = re.findall(r"^FROM (\S+)(?: AS (\S+))?", dockerfile, re.MULTILINE)
    floor = answers(variant)["python_version"]
    assert stages[1:] == [
        (f"python:{floor}-slim", "build"),
        (f"python:{floor}-slim", "runtime"),
        ("runtime", "development"),
        ("runtime", "production"),  # the last stage, so the default target: no source, no reload
    ]
    assert dockerfile.rstrip().endswith("FROM runtime AS production")
    assert "uv sync --locked --no-dev --no-editable" in dockerfile
    user = re.findall(r"^USER (\S+)", dockerfile, re.MULTILINE)
    assert user
    assert not user[-1].startswith(("root", "0"))
    assert re.search(r"^HEALTHCHECK .*\n.*/livez", dockerfile, re.MULTILINE)
    ignored = (project / ".dockerignore").read_text().split()
    assert {".env", ".venv", ".git", "tests"} <= set(ignored)


def test_the_pre_commit_hooks_pass_on_a_fresh_service(
    bakes: dict[str, Path], shared_python: Path, tmp_path: Path
) -> None:
    """Validated, then run: the hooks use the service's .venv (here the shared environment),
    and a freshly generated service passes every one of them."""
    project = tmp_path / "service"
    shutil.copytree(bakes["default"], project, ignore=shutil.ignore_patterns(".venv", "*_cache"))
    (project / ".venv").symlink_to(shared_python.parents[1])
    identity = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com"}
    identity |= {"GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"}
    check(["git", "init", "--quiet"], project)
    check(["git", "add", "--all"], project, env=identity)
    pre_commit = str(BIN / "pre-commit")
    check([pre_commit, "validate-config", ".pre-commit-config.yaml"], project)
    config = yaml.safe_load((project / ".pre-commit-config.yaml").read_text())
    hooks = {hook["id"] for repo in config["repos"] for hook in repo["hooks"]}
    assert {"ruff-check", "ruff-format", "mypy", "import-contracts", "check-yaml", "check-toml"} <= hooks
    env = {
        "PRE_COMMIT_HOME": str(tmp_path / "pre-commit-home"),
        "MYPY_CACHE_DIR": str(shared_python.parents[2] / ".mypy_cache"),
        "PATH": f"{shared_python.parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    result = check([pre_commit, "run", "--all-files", "--color", "never"], project, env=env, timeout=600)
    assert all(f"{name}" in result.stdout for name in ("ruff check", "mypy --strict", "import contracts"))
    assert "Failed" not in result.stdout
    # `make hooks` as the README says (`-o install`: the shared environment stands for `make install`).
    check(["make", "-o", "install", "hooks"], project, env=env)
    assert "pre-commit" in (project / ".git" / "hooks" / "pre-commit").read_text()


@pytest.mark.parametrize("variant", ["default", "kafka"])
def test_the_development_compose_override_syncs_the_source_and_restarts(
    bakes: dict[str, Path], variant: str
) -> None:
    """`docker compose -f docker-compose.yml -f docker-compose.dev.yml watch`: the API and the
    worker get the source synced in and start again; the image they run is the development stage,
    whose path puts the synced source first."""
    project = bakes[variant]
    base = yaml.safe_load((project / "docker-compose.yml").read_text())["services"]
    override = yaml.safe_load((project / "docker-compose.dev.yml").read_text())["services"]
    assert set(override) <= set(base)
    assert override["migrator"]["build"] == {"context": ".", "target": "development"}
    dockerfile = (project / "Dockerfile").read_text()
    development = dockerfile.split("FROM runtime AS development", 1)[1].split("FROM ", 1)[0]
    assert "PYTHONPATH=/app/src:/app/kit/src" in development
    for service in ("api", "worker"):
        watch = override[service]["develop"]["watch"]
        synced = {rule["path"]: rule["target"] for rule in watch if rule["action"] == "sync+restart"}
        assert synced == {"./src": "/app/src", "./kit/src": "/app/kit/src"}
        for rule in watch:
            assert (project / rule["path"]).exists() or rule["path"] == "./uv.lock", rule
        assert "--reload" not in base[service]["command"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_bake_carries_the_templates_lock_with_its_own_name_and_floor(
    bakes: dict[str, Path], variant: str
) -> None:
    """Services generated on different days install the same versions: the lock comes with the
    bake (made by `make lock` from the template, installed by the template's CI), named for the
    service and bounded by its Python floor, and uv accepts it as up to date."""
    project = bakes[variant]
    lock = (project / "uv.lock").read_text()
    assert f'\nname = "{project.name}"\n' in lock
    assert f'\nrequires-python = ">={answers(variant)["python_version"]}"\n' in lock
    if variant in {"default", "long-name-py313"}:  # the oldest and the newest floor
        python = find_python(str(answers(variant)["python_version"]))
        assert python is not None, "this machine has each supported Python"
        check([str(BIN / "uv"), "lock", "--check", "--python", python], project, env=TOOLS_ENV)


def test_the_templates_own_automation_is_valid() -> None:
    """Dependabot keeps the template's tools moving; the lock workflow keeps the services' lock
    moving (Dependabot cannot render the template around it)."""
    root = Path(__file__).resolve().parents[1]
    check(
        [str(BIN / "check-jsonschema"), "--builtin-schema", "vendor.dependabot", ".github/dependabot.yml"],
        root,
    )
    workflow = ".github/workflows/lock.yml"
    check([str(BIN / "check-jsonschema"), "--builtin-schema", "vendor.github-workflows", workflow], root)
    steps = yaml.safe_load((root / workflow).read_text())["jobs"]["lock"]["steps"]
    assert any(step.get("run") == "make lock UPGRADE=1" for step in steps)
