"""Refresh the locks: `make lock` (UPGRADE=1 takes newer versions).

Two locks: the one every generated service starts with (``{{cookiecutter.service_slug}}/uv.lock``)
and the kit's own (``{{cookiecutter.service_slug}}/kit/uv.lock``), from which the template's kit
tier installs the kit's test environment (``uv sync --locked``), so a fresh clone tests the
versions that were tested here, not whatever the index serves that day.

A service generated today and one generated next month install the same versions: the bake
carries ``uv.lock``, which this script makes from a default bake (``uv lock``, keeping the
versions already locked unless ``--upgrade``) and writes back into the template with the two
answers it depends on left as template fields: the service's name and ``requires-python``. The
dependency list has no template branches, so one lock fits every answer; a lock made for the
lowest supported Python stays valid for a higher floor (uv checks it: ``uv lock --check``). The
template's CI installs it on the oldest and the newest supported Python (tests/test_*.py bake and
``make install`` with ``uv sync --locked``), so the versions users get are the tested ones.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parents[1]
SERVICE = TEMPLATE / "{{cookiecutter.service_slug}}"
LOCK = SERVICE / "uv.lock"
KIT = SERVICE / "kit"
SLUG = "order-service"  # the default answer
FLOOR = "3.11"  # the lowest python_version answer
NAME_FIELD = '"{{ cookiecutter.service_slug }}"'
FLOOR_FIELD = '">={{ cookiecutter.python_version }}"'


def templated(lock: str) -> str:
    """A default bake's lock with its two answers as template fields."""
    root = f'\nname = "{SLUG}"\n'
    if lock.count(root) != 1:
        msg = f"expected one package named {SLUG} in the lock"
        raise SystemExit(msg)
    lock = lock.replace(root, f"\nname = {NAME_FIELD}\n")
    floor = rf'^requires-python = ">={re.escape(FLOOR)}"$'
    lock, found = re.subn(floor, f"requires-python = {FLOOR_FIELD}", lock, count=1, flags=re.MULTILINE)
    if found != 1:
        msg = f"expected requires-python >={FLOOR} in the lock"
        raise SystemExit(msg)
    if "{%" in lock or lock.count("{{") != 2:
        msg = "the lock holds template syntax of its own: it would be rendered wrong"
        raise SystemExit(msg)
    return lock


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--upgrade", action="store_true", help="take the newest versions the ranges allow")
    parser.add_argument("--uv", default=shutil.which("uv") or "uv")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        cookiecutter = Path(sys.executable).parent / "cookiecutter"
        subprocess.run([str(cookiecutter), "--no-input", "--output-dir", scratch, str(TEMPLATE)], check=True)
        bake = Path(scratch) / SLUG  # with the current lock rendered: its versions are kept
        command = [args.uv, "lock", *(["--upgrade"] if args.upgrade else [])]
        subprocess.run(command, cwd=bake, check=True)
        LOCK.write_text(templated((bake / "uv.lock").read_text()))
        # The kit is locked from a copy: uv reads the pyproject files of the folders above a
        # project, and the template's service one holds template syntax.
        kit = Path(scratch) / "kit"
        shutil.copytree(KIT, kit, ignore=shutil.ignore_patterns(".venv", "__pycache__", "*_cache"))
        subprocess.run(command, cwd=kit, check=True)
        (KIT / "uv.lock").write_text((kit / "uv.lock").read_text())
    print(f"wrote {LOCK.relative_to(TEMPLATE)} and {(KIT / 'uv.lock').relative_to(TEMPLATE)}")


if __name__ == "__main__":
    main()
