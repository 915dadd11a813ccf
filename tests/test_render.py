"""Tier 1, render: every option bakes into a clean, lint-free, strictly typed project."""

from __future__ import annotations

import compileall
import re
import tomllib
from pathlib import Path

import pytest
import yaml

from .conftest import VARIANTS
from .support import check, load_answer_rules, text_files

pytestmark = pytest.mark.render
LEFTOVER = re.compile(r"(?<!\$)\{\{|\{%|\{#")
EXAMPLE_PATHS = (
    "src/order_service/contexts/orders",
    "src/order_service/contexts/notifications",
    "src/order_service/contracts/orders.py",
    "migrations/versions/0002_example_contexts.py",
)


# The settings the post-gen hook generates afresh into .env (every other line is the example's).
GENERATED_SECRETS = {"AUTH__JWT_SECRET", "MESSAGE_BUS__SIGNING_KEYS"}
PUBLISHED_SECRETS = ("dev-only-secret-change-me", "change-me")


def env_values(path: Path) -> dict[str, str]:
    lines = path.read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


def assert_env_is_the_example_with_fresh_secrets(project: Path) -> None:
    example = (project / ".env.example").read_text().splitlines()
    env = (project / ".env").read_text().splitlines()
    differing = {line.split("=", 1)[0] for line, twin in zip(example, env, strict=True) if line != twin}
    assert differing == GENERATED_SECRETS
    values = env_values(project / ".env")
    kid, _, key = values["MESSAGE_BUS__SIGNING_KEYS"].partition(":")
    assert kid == values["MESSAGE_BUS__SIGNING_KEY_ID"]  # the generated key is the one that signs
    for secret in (values["AUTH__JWT_SECRET"], key):
        assert len(secret.encode()) >= 32  # what production asks of an HS256 key
        assert not secret.startswith(PUBLISHED_SECRETS)
    assert values["AUTH__JWT_SECRET"] != key


def test_every_generated_service_has_secrets_of_its_own(bakes: dict[str, Path]) -> None:
    """Anyone can read the template: a secret it publishes would let anyone mint an admin token
    for every service generated from it."""
    first, second = env_values(bakes["default"] / ".env"), env_values(bakes["kafka"] / ".env")
    assert all(first[name] != second[name] for name in GENERATED_SECRETS)


@pytest.mark.parametrize("variant", VARIANTS)
def test_compose_reads_secrets_from_env_and_publishes_on_loopback(
    bakes: dict[str, Path], variant: str
) -> None:
    text = (bakes[variant] / "docker-compose.yml").read_text()
    services = yaml.safe_load(text)["services"]
    published = {name: [str(port) for port in s.get("ports", [])] for name, s in services.items()}
    assert all(port.startswith("127.0.0.1:") for ports in published.values() for port in ports), published
    assert published["api"] == ["127.0.0.1:8000:8000"]
    for name in ("migrator", "api", "worker"):
        assert services[name]["env_file"] == [".env"], name
        assert not GENERATED_SECRETS & set(services[name]["environment"]), name
    assert not any(secret in text for secret in PUBLISHED_SECRETS)


@pytest.mark.parametrize("variant", VARIANTS)
def test_compose_probes_the_worker_on_a_port_of_its_own(bakes: dict[str, Path], variant: str) -> None:
    """The worker serves /livez, /readyz and /metrics only when given a port: compose gives it one,
    publishes it on loopback and probes its /livez (not the API's, not the database)."""
    worker = yaml.safe_load((bakes[variant] / "docker-compose.yml").read_text())["services"]["worker"]
    command = worker["command"]
    port = command[command.index("--port") + 1]
    assert port != "8000"
    assert worker["ports"] == [f"127.0.0.1:{port}:{port}"]
    assert f"http://localhost:{port}/livez" in " ".join(worker["healthcheck"]["test"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_no_template_syntax_is_left(bakes: dict[str, Path], variant: str) -> None:
    offenders = []
    for path in text_files(bakes[variant]):
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        if LEFTOVER.search(text):
            offenders.append(str(path.relative_to(bakes[variant])))
    assert offenders == []


@pytest.mark.parametrize("variant", VARIANTS)
def test_config_files_parse(bakes: dict[str, Path], variant: str) -> None:
    project = bakes[variant]
    pyproject = tomllib.loads((project / "pyproject.toml").read_text())
    assert pyproject["project"]["name"] == project.name
    assert pyproject["tool"]["mypy"]["strict"] is True
    compose = yaml.safe_load((project / "docker-compose.yml").read_text())
    assert {"postgres", "migrator", "api", "worker"} <= set(compose["services"])
    workflow = yaml.safe_load((project / ".github/workflows/ci.yml").read_text())
    assert "jobs" in workflow
    assert_env_is_the_example_with_fresh_secrets(project)
    assert compileall.compile_dir(project / "src", quiet=1, force=True)
    assert compileall.compile_dir(project / "tests", quiet=1, force=True)


@pytest.mark.parametrize("broker", ["rabbitmq", "kafka", "nats", "redis"])
def test_broker_answer_sets_defaults_not_code(bakes: dict[str, Path], broker: str) -> None:
    """Every transport stays available at run time: the answer changes no Python file."""
    project = bakes["default" if broker == "rabbitmq" else broker]
    compose = yaml.safe_load((project / "docker-compose.yml").read_text())
    assert broker in compose["services"]
    assert (
        f"# inprocess | rabbitmq | kafka | nats | redis   (this template's broker default: {broker})"
        in (project / ".env.example").read_text()
    )
    default = bakes["default"]
    for path in (default / "src").rglob("*.py"):  # same slug: the broker variants keep the name
        if path.name != "about.py":
            assert path.read_text() == (project / path.relative_to(default)).read_text(), path


def test_the_service_ships_the_architecture_page_of_the_template(bakes: dict[str, Path]) -> None:
    """One page, two homes: the template's docs/architecture.md is what every service ships."""
    template_page = (Path(__file__).parents[1] / "docs" / "architecture.md").read_text()
    for project in bakes.values():
        assert (project / "docs" / "architecture.md").read_text() == template_page


def test_example_off_removes_the_example(bakes: dict[str, Path]) -> None:
    for relative in EXAMPLE_PATHS:
        assert (bakes["default"] / relative).exists(), relative
        assert not (bakes["no-example"] / relative).exists(), relative
    leftovers = [p.name for p in (bakes["no-example"] / "tests").rglob("test_example_*.py")]
    assert leftovers == []


@pytest.mark.parametrize("variant", VARIANTS)
def test_ruff_mypy_and_import_contracts(bakes: dict[str, Path], shared_python: Path, variant: str) -> None:
    project = bakes[variant]
    bin_dir = shared_python.parent
    check([str(bin_dir / "ruff"), "check", "."], project)
    check([str(bin_dir / "ruff"), "format", "--check", "."], project)
    cache = shared_python.parents[2] / ".mypy_cache"
    check([str(bin_dir / "mypy"), "--cache-dir", str(cache)], project)
    check([str(bin_dir / "lint-imports")], project, env={"PYTHONPATH": str(project / "src")})


def test_the_package_name_rules_know_every_installed_module(shared_python: Path) -> None:
    """A package named like any module the service installs (a dependency of a dependency
    included, ``click`` or ``idna``) would shadow it: the hook's list must name them all."""
    listing = check(
        [
            str(shared_python),
            "-c",
            "import importlib.metadata as m; print('\\n'.join(sorted(m.packages_distributions())))",
        ],
        shared_python.parents[2],
    ).stdout.split()
    rules = load_answer_rules()
    installed = {name for name in listing if name.isidentifier() and not name.startswith("_")}
    missing = sorted(
        name for name in installed if rules.check_identifier("p", name, allow_hyphen=False) is None
    )
    assert missing == [], f"add these to DEPENDENCY_NAMES in hooks/validation.py: {missing}"
