"""Tier 1, render: every option bakes into a clean, lint-free, strictly typed project."""

from __future__ import annotations

import compileall
import json
import re
import tomllib
from pathlib import Path

import pytest
import yaml

from .conftest import VARIANTS
from .support import TEMPLATE, check, load_answer_rules, text_files

pytestmark = pytest.mark.render
# Not Jinja: GitHub Actions' ``${{ ... }}`` and Prometheus' ``{{ $labels.x }}`` (alert templates).
LEFTOVER = re.compile(r"(?<!\$)\{\{(?! ?\$)|\{%|\{#")
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
def test_compose_runs_one_image_for_migrator_api_and_worker(bakes: dict[str, Path], variant: str) -> None:
    services = yaml.safe_load((bakes[variant] / "docker-compose.yml").read_text())["services"]
    images = {services[name]["image"] for name in ("migrator", "api", "worker")}
    assert len(images) == 1
    assert [name for name in ("migrator", "api", "worker") if "build" in services[name]] == ["migrator"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_no_template_syntax_is_left(bakes: dict[str, Path], variant: str) -> None:
    """Outside ``kit/``: it is copied unrendered (``_copy_without_render``), so a ``{{`` of its
    Python is its own; the kit tier proves every bake carries it byte for byte."""
    offenders = []
    kit = bakes[variant] / "kit"
    for path in text_files(bakes[variant]):
        if path.is_relative_to(kit):
            continue
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


SERVICE_DOCS = (
    "architecture",
    "semantics",
    "operations",
    "extending",
    "upgrading",
    "performance",
    "reliability",
    "troubleshooting",
)
MARKDOWN_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_service_ships_its_docs_and_every_link_in_them_resolves(
    bakes: dict[str, Path], variant: str
) -> None:
    project = bakes[variant]
    pages = [project / "README.md", *(project / "docs" / f"{name}.md" for name in SERVICE_DOCS)]
    broken = [
        f"{page.relative_to(project)} -> {target}"
        for page in pages
        for target in MARKDOWN_LINK.findall(page.read_text())
        if "://" not in target and not (page.parent / target).exists()
    ]
    assert broken == []
    readme = (project / "README.md").read_text()
    assert all(f"(docs/{name}.md)" in readme for name in SERVICE_DOCS)


def test_the_template_docs_link_to_pages_that_exist() -> None:
    pages = [TEMPLATE / "README.md", TEMPLATE / "CHANGELOG.md", *(TEMPLATE / "docs").glob("*.md")]
    broken = [
        f"{page.relative_to(TEMPLATE)} -> {target}"
        for page in pages
        for target in MARKDOWN_LINK.findall(page.read_text())
        if "://" not in target and not (page.parent / target.replace("%7B", "{").replace("%7D", "}")).exists()
    ]
    assert broken == []


SERVICE = TEMPLATE / "{{cookiecutter.service_slug}}"


def test_the_docs_name_the_newest_migration_and_every_revision() -> None:
    """extending.md once called `0003` the newest revision after `0004` had shipped, and told
    whoever followed it to add a second `0004`."""
    revisions = sorted(path.name[:4] for path in (SERVICE / "migrations" / "versions").glob("[0-9]*.py"))
    extending = (SERVICE / "docs" / "extending.md").read_text()
    (newest,) = re.findall(r"the newest in `migrations/versions/` is `(\d{4})`", extending)
    assert newest == revisions[-1]
    (rev_id,) = re.findall(r"--rev-id (\d{4})", extending)
    assert int(rev_id) == int(newest) + 1
    layout = next(
        line
        for line in (SERVICE / "docs" / "architecture.md").read_text().splitlines()
        if line.startswith("migrations/")
    )
    policy = (SERVICE / "docs" / "upgrading.md").read_text().split("## Migrations policy", 1)[1]
    assert [r for r in revisions if r not in layout or f"`{r}`" not in policy] == []


def test_upgrading_says_once_that_the_template_carries_uv_lock() -> None:
    """upgrading.md said both that `uv.lock` is and is not part of the template; it is."""
    assert (SERVICE / "uv.lock").is_file()
    upgrading = (SERVICE / "docs" / "upgrading.md").read_text()
    assert "`uv.lock` is not part of the template" not in upgrading
    assert upgrading.count("`uv.lock` is part of the template") == 1
    assert "-x uv.lock" not in upgrading  # a replayed bake has one: compare it too


def test_a_service_without_the_example_is_not_told_about_it(bakes: dict[str, Path]) -> None:
    """No /orders call, and no pointer at the example's files as if the service had them."""
    project = bakes["no-example"]
    readme = (project / "README.md").read_text()
    docs = {page.name: page.read_text() for page in (project / "docs").glob("*.md")}
    assert "/orders" not in readme
    assert [name for name, text in docs.items() if "curl" in text and "/orders" in text] == []
    assert "copy the files of `contexts/orders/`" not in docs["extending.md"]
    assert "generated without the example contexts" in docs["extending.md"]
    assert re.search(r"^ +orders/ ", docs["architecture.md"], re.MULTILINE) is None
    default_layout = (bakes["default"] / "docs" / "architecture.md").read_text()
    assert re.search(r"^ +orders/ ", default_layout, re.MULTILINE) is not None


def test_example_off_removes_the_example(bakes: dict[str, Path]) -> None:
    for relative in EXAMPLE_PATHS:
        assert (bakes["default"] / relative).exists(), relative
        assert not (bakes["no-example"] / relative).exists(), relative
    leftovers = [p.name for p in (bakes["no-example"] / "tests").rglob("test_example_*.py")]
    assert leftovers == []


@pytest.mark.parametrize("variant", VARIANTS)
def test_ruff_mypy_and_import_contracts(bakes: dict[str, Path], shared_python: Path, variant: str) -> None:
    project = bakes[variant]
    if variant == "default":  # the documented commands, on the service's own .venv
        cache = {"MYPY_CACHE_DIR": str(shared_python.parents[2] / ".mypy_cache")}
        check(["make", "lint", "typecheck"], project, env=cache)
        return
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


def test_the_options_page_shows_the_recorded_answers_as_a_bake_writes_them(bakes: dict[str, Path]) -> None:
    page = (TEMPLATE / "docs" / "options.md").read_text()
    block = re.search(r"## Recorded answers.*?```json\n(.*?)```", page, re.DOTALL)
    assert block is not None
    assert json.loads(block.group(1)) == json.loads((bakes["default"] / ".cookiecutter.json").read_text())


def test_the_options_page_lists_every_path_include_example_false_removes(bakes: dict[str, Path]) -> None:
    """What the page names is exactly what a bare bake lacks beside a default one."""
    page = (TEMPLATE / "docs" / "options.md").read_text()
    section = page.split("## What `include_example=false` removes", 1)[1].split("\nWhat stays", 1)[0]
    named = re.findall(r"^\| `([^`]+)`", section, re.MULTILINE)
    bare, default = bakes["no-example"], bakes["default"]
    covered: set[Path] = set()
    for pattern in named:
        matches = list(default.glob(pattern.replace("<package>", "order_service").rstrip("/")))
        assert matches, f"the page names {pattern}, which a default bake does not have"
        covered |= {m.relative_to(default) for m in matches}
    generated = [  # other tests install and lint these bakes: leave their caches out
        path.relative_to(default)
        for folder in ("src", "migrations", "tests")
        for path in (default / folder).rglob("*")
        if "__pycache__" not in path.parts
    ]
    missing = {path for path in generated if not (bare / path).exists()}
    topmost = {path for path in missing if not any(parent in missing for parent in path.parents)}
    assert topmost == covered, (topmost - covered, covered - topmost)
