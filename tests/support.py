"""Baking, installing and running generated services for the template's tests."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

from cookiecutter.main import cookiecutter

TEMPLATE = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
UV = shutil.which("uv", path=str(BIN)) or shutil.which("uv")
REQUIRE_SERVICES = os.environ.get("REQUIRE_SERVICES") == "1"
# This environment's tools (uv among them) first on PATH, and never a Python download: a baked
# service is installed on the interpreter running the tests.
TOOLS_ENV = {"PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "UV_PYTHON_DOWNLOADS": "never"}


def bake(output: Path, **answers: object) -> Path:
    """Generate a service with the defaults overridden by ``answers``; return its folder."""
    output.mkdir(parents=True, exist_ok=True)
    return Path(cookiecutter(str(TEMPLATE), no_input=True, output_dir=str(output), extra_context=answers))


def run(
    command: list[str], cwd: Path, *, env: Mapping[str, str] | None = None, timeout: float = 900
) -> subprocess.CompletedProcess[str]:
    """Run a command, returning its result (stdout and stderr captured as text)."""
    merged = {**os.environ, **(env or {})}
    return subprocess.run(
        command, cwd=cwd, env=merged, capture_output=True, text=True, timeout=timeout, check=False
    )


def check(command: list[str], cwd: Path, **kwargs: object) -> subprocess.CompletedProcess[str]:
    result = run(command, cwd, **kwargs)  # type: ignore[arg-type]
    if result.returncode != 0:
        raise AssertionError(
            f"{' '.join(command)} failed ({result.returncode}) in {cwd}\n"
            f"--- stdout ---\n{result.stdout[-6000:]}\n--- stderr ---\n{result.stderr[-6000:]}"
        )
    return result


def install(project: Path, interpreter: str = sys.executable) -> Path:
    """Create ``.venv`` in a baked project the way its users do: ``make install`` (with this
    environment's uv on PATH: ``uv sync --locked`` with the ``uv.lock`` the bake carries)
    on ``interpreter`` (the one running these tests unless told)."""
    python = project / ".venv" / "bin" / "python"
    if python.exists():
        return python
    check(["make", "install", f"PYTHON={interpreter}"], project, env=TOOLS_ENV)
    return python


def find_python(version: str) -> str | None:
    """An interpreter of ``version`` (``"3.13"``) that runs: ``python3.13`` on PATH, a pyenv
    installation (whose shim answers only for the selected versions), or uv's discovery."""
    candidates = [shutil.which(f"python{version}") or ""]
    pyenv_versions = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates += sorted(map(str, pyenv_versions.glob(f"{version}*/bin/python{version}")), reverse=True)
    if UV:
        found = run([UV, "python", "find", version], TEMPLATE, env=TOOLS_ENV, timeout=60)
        candidates.append(found.stdout.strip() if found.returncode == 0 else "")
    for candidate in filter(None, candidates):
        probe = run([candidate, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], TEMPLATE)
        if probe.returncode == 0 and probe.stdout.strip() == version:
            return candidate
    return None


def text_files(root: Path) -> list[Path]:
    skip = {".venv", ".git", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache"}
    found = []
    for path in root.rglob("*"):
        if path.is_file() and not skip.intersection(path.relative_to(root).parts):
            found.append(path)
    return found


def load_answer_rules() -> ModuleType:
    """``hooks/validation.py`` as a module (it is loaded by path, as the pre-gen hook does)."""
    spec = importlib.util.spec_from_file_location("answer_rules", TEMPLATE / "hooks" / "validation.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
