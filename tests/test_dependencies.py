"""Tier 3, generated: the dependency floors are true, and both install paths give the locked set.

``--resolution lowest-direct`` installs every direct dependency (runtime and the ``dev`` group)
at the lowest version ``pyproject.toml`` allows; the unit and architecture tiers and ruff must
pass there, so a floor cannot claim more than the code supports. The plain-pip path of
``make install`` (for machines without uv) must install the versions of ``uv.lock``."""

from __future__ import annotations

import json
import os
import re
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from .support import TOOLS_ENV, UV, bake, check, find_python, run

pytestmark = pytest.mark.generated


def installed_versions(python: Path, project: Path) -> dict[str, Version]:
    listing = check([str(UV), "pip", "list", "--python", str(python), "--format", "json"], project)
    return {canonicalize_name(p["name"]): Version(p["version"]) for p in json.loads(listing.stdout)}


def floors(project: Path) -> dict[str, Version]:
    """Every direct dependency's lower bound (each one must have one)."""
    pyproject = tomllib.loads((project / "pyproject.toml").read_text())
    requirements = [*pyproject["project"]["dependencies"], *pyproject["dependency-groups"]["dev"]]
    found = {}
    for requirement in map(Requirement, requirements):
        (floor,) = [s.version for s in requirement.specifier if s.operator == ">="]
        found[canonicalize_name(requirement.name)] = Version(floor)
    return found


def test_the_service_passes_its_unit_and_architecture_tiers_at_its_lowest_direct_versions(
    tmp_path: Path,
) -> None:
    project = bake(tmp_path)
    python = project / ".venv" / "bin" / "python"
    check([str(UV), "venv", "--quiet", "--python", sys.executable, ".venv"], project, env=TOOLS_ENV)
    install = [str(UV), "pip", "install", "--quiet", "--python", str(python), "--resolution", "lowest-direct"]
    check([*install, "-e", ".", "--group", "dev"], project, env=TOOLS_ENV)
    installed = installed_versions(python, project)
    wanted = floors(project)
    assert {name: installed[name] for name in wanted} == wanted  # each at its floor, none above
    bin_dir = python.parent
    check([str(bin_dir / "ruff"), "check", "."], project)
    check([str(bin_dir / "ruff"), "format", "--check", "."], project)
    tiers = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "unit or architecture"]
    result = check(tiers, project, timeout=900)
    print(result.stdout[-1500:])


def test_without_uv_make_install_uses_pip_and_the_versions_of_the_lock(tmp_path: Path) -> None:
    """A machine without uv gets the versions the template's CI installs with uv: those of the
    lock the bake carries (no `make lock`: there is no uv to run it)."""
    project = bake(tmp_path)
    locked = {
        canonicalize_name(p["name"]): Version(p["version"])
        for p in tomllib.loads((project / "uv.lock").read_text())["package"]
        if "registry" in p["source"]
    }
    check(["make", "install", "UV=", f"PYTHON={sys.executable}"], project, timeout=900)
    python = project / ".venv" / "bin" / "python"
    pip_list = check([str(python), "-m", "pip", "list", "--format", "json"], project)
    installed = {canonicalize_name(p["name"]): Version(p["version"]) for p in json.loads(pip_list.stdout)}
    expected = {"faststream", "fastapi", "sqlalchemy", "pytest", "mypy", "pre-commit", "aiokafka"}
    assert {name: installed[name] for name in expected} == {name: locked[name] for name in expected}
    differing = {n: (installed[n], v) for n, v in locked.items() if n in installed and installed[n] != v}
    assert differing == {}
    check([str(python), "-c", "import order_service.container"], project)


def test_make_install_finds_a_python_that_fits_and_replaces_an_older_venv(tmp_path: Path) -> None:
    """A service for Python 3.13 on a machine whose python3 is older and whose 3.13 is only in
    pyenv's versions (its python3.13 shim answers only when selected): `make install` finds the
    3.13, makes the leftover .venv of the older Python again, and where nothing fits says in one
    line what to run."""
    older, newest = find_python("3.11"), find_python("3.13")
    if older is None or newest is None:
        pytest.fail("this machine has Python 3.11 and 3.13 (pyenv versions): one did not answer")
    project = bake(tmp_path / "bake", python_version="3.13")
    first_on_path = tmp_path / "bin"
    first_on_path.mkdir()
    (first_on_path / "python3").symlink_to(older)
    versions = tmp_path / "pyenv" / "versions" / "3.13.0" / "bin"
    versions.mkdir(parents=True)
    (versions / "python3").symlink_to(newest)
    check([older, "-m", "venv", ".venv"], project)  # what a failed first try left behind
    env = {
        **TOOLS_ENV,
        "PATH": f"{first_on_path}{os.pathsep}{TOOLS_ENV['PATH']}",
        "PYENV_ROOT": str(tmp_path / "pyenv"),
    }
    output = check(["make", "install"], project, env=env, timeout=900).stdout
    assert f"make install: {versions / 'python3'} (Python 3.13" in output, output[-2000:]
    version = check([str(project / ".venv" / "bin" / "python"), "-V"], project).stdout
    assert version.startswith("Python 3.13"), version

    (tmp_path / "empty").mkdir()
    nothing_fits = run(
        ["make", "install"], project, env={**env, "PYENV_ROOT": str(tmp_path / "empty"), "UV": ""}
    )
    assert nothing_fits.returncode == 2
    (line,) = [line for line in nothing_fits.stderr.splitlines() if line.startswith("make install:")]
    assert "no Python 3.13 or newer found (python3 is Python 3.11" in line, line
    assert "uv python install 3.13" in line, line


def test_make_audit_checks_every_locked_dependency(tmp_path: Path) -> None:
    """`make audit` (and the generated CI's audit job) hands pip-audit the lock's exact versions
    with their hashes, nothing installed. The advisory lookup needs the network, so here it runs
    as a dry run: every locked package is collected."""
    project = bake(tmp_path)
    result = check(["make", "audit", "AUDIT_ARGS=--dry-run"], project, env=TOOLS_ENV, timeout=600)
    audited = re.search(r"would have audited (\d+) packages", result.stdout + result.stderr)
    assert audited, result.stderr[-2000:]
    lock = tomllib.loads((project / "uv.lock").read_text())["package"]
    registry = [p["name"] for p in lock if "registry" in p["source"]]
    exported = (project / ".venv" / "audit-requirements.txt").read_text()
    pinned = re.findall(r"^([a-z0-9][a-z0-9._-]*)==\S+ \\\n\s+--hash=sha256:", exported, re.MULTILINE)
    assert set(pinned) <= set(registry)
    assert len(pinned) >= 0.9 * len(registry)  # those of other platforms (markers) aside
    assert int(audited.group(1)) >= len(pinned) - 5  # markers pip-audit evaluates out
