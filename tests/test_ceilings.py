"""Tier 0, kit: every dependency the template declares has a floor and a ceiling, and every lock
holds versions inside them.

A dependency without a ceiling breaks a fresh clone the day its next major is published (the
day PyPI served sentry-sdk 3.0.0, which removed an API the kit used, the kit's strict types and
two of its tests failed on every new machine). So each requirement of the kit, of the generated
service and of the template's own tools says ``>=floor,<ceiling``, the ceiling below the next
major release (below the next minor for a pre-1.0 package), and the test environments install
from locks whose versions these ranges allow.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from .support import TEMPLATE

pytestmark = pytest.mark.kit

SERVICE = TEMPLATE / "{{cookiecutter.service_slug}}"
KIT = SERVICE / "kit"


def without_template_fields(text: str) -> str:
    """The service's pyproject.toml with its few template fields filled in, so TOML reads it."""
    quoted = re.sub(r'"[^"\n]*\{\{.*?\}\}[^"\n]*"', '"x"', text)  # a field inside a string
    return re.sub(r"\{\{.*?\}\}", '"x"', quoted)  # a field that is a whole value


def pyproject_requirements(path: Path) -> list[str]:
    data = tomllib.loads(without_template_fields(path.read_text(encoding="utf-8")))
    project = data["project"]
    return [
        *project["dependencies"],
        *(r for extra in project.get("optional-dependencies", {}).values() for r in extra),
        *(r for group in data.get("dependency-groups", {}).values() for r in group),
        *data["build-system"]["requires"],
    ]


def requirements_file(path: Path) -> list[str]:
    lines = (line.split("#")[0].strip() for line in path.read_text(encoding="utf-8").splitlines())
    return [line for line in lines if line and not line.startswith("-r")]


DECLARED = {
    "kit/pyproject.toml": pyproject_requirements(KIT / "pyproject.toml"),
    "service pyproject.toml": pyproject_requirements(SERVICE / "pyproject.toml"),
    "requirements-dev.txt": requirements_file(TEMPLATE / "requirements-dev.txt"),
    "requirements-demo.txt": requirements_file(TEMPLATE / "requirements-demo.txt"),
}


def is_major_ceiling(version: Version) -> bool:
    """``<N`` (the next major) or ``<0.N`` (the next minor of a pre-1.0 package)."""
    release = version.release
    return len(release) == 1 or (len(release) == 2 and release[0] == 0)


@pytest.mark.parametrize("where", DECLARED)
def test_every_requirement_has_a_floor_and_a_ceiling_below_a_major(where: str) -> None:
    unbounded = []
    for requirement in map(Requirement, DECLARED[where]):
        operators = {spec.operator: Version(spec.version) for spec in requirement.specifier}
        if "==" in operators:  # an exact pin (a tool whose behaviour a test fixes) is bounded
            continue
        ceiling = operators.get("<")
        if ">=" not in operators or ceiling is None or not is_major_ceiling(ceiling):
            unbounded.append(str(requirement))
    assert unbounded == [], f"{where}: give each a floor and a ceiling below its next major"


def locked_versions(lock: Path) -> dict[str, Version]:
    if lock.suffix == ".lock" and lock.name.startswith("requirements"):
        pins = re.findall(r"^([A-Za-z0-9_.-]+)==([^\s;]+)", lock.read_text(encoding="utf-8"), re.MULTILINE)
        return {canonicalize_name(name): Version(version) for name, version in pins}
    packages = tomllib.loads(without_template_fields(lock.read_text(encoding="utf-8")))["package"]
    return {canonicalize_name(p["name"]): Version(p["version"]) for p in packages if "version" in p}


LOCKS = {
    "kit/uv.lock": (KIT / "uv.lock", ["kit/pyproject.toml"]),
    "service uv.lock": (SERVICE / "uv.lock", ["service pyproject.toml"]),
    "requirements-dev.lock": (
        TEMPLATE / "requirements-dev.lock",
        ["requirements-dev.txt", "requirements-demo.txt"],
    ),
    "requirements-demo.lock": (TEMPLATE / "requirements-demo.lock", ["requirements-demo.txt"]),
}


@pytest.mark.parametrize("lock", LOCKS)
def test_each_lock_holds_versions_its_ranges_allow(lock: str) -> None:
    path, sources = LOCKS[lock]
    locked = locked_versions(path)
    outside = []
    for requirement in (Requirement(r) for source in sources for r in DECLARED[source]):
        name = canonicalize_name(requirement.name)
        if name in locked and not requirement.specifier.contains(locked[name], prereleases=True):
            outside.append(f"{requirement} (locked {locked[name]})")
        if name not in locked and name not in {"hatchling"}:  # the build backend is not locked
            outside.append(f"{requirement} (not in the lock)")
    assert outside == [], f"{lock}: run `make lock`"
