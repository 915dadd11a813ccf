"""Tier 2, hooks: a bad answer is one readable line and creates nothing; hostile free text
round-trips into valid generated files."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from .support import TEMPLATE, bake

pytestmark = pytest.mark.hooks


def bake_cli(output: Path, *answers: str) -> subprocess.CompletedProcess[str]:
    """Run cookiecutter the way a user does (its CLI), with ``key=value`` answers."""
    command = [sys.executable, "-m", "cookiecutter", "--no-input", "--output-dir", str(output), str(TEMPLATE)]
    return subprocess.run([*command, *answers], capture_output=True, text=True, check=False, timeout=120)


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        ("service_slug=Order-Service", "service_slug 'Order-Service' must be lowercase letters"),
        ("service_slug=9lives", "service_slug '9lives' must be lowercase letters"),
        ("service_slug=my--service", "service_slug 'my--service' must be lowercase letters"),
        ("package_name=order-service", "package_name 'order-service' must be a lowercase Python identifier"),
        ("package_name=Orders", "package_name 'Orders' must be a lowercase Python identifier"),
        ("package_name=class", "package_name 'class' is a Python keyword"),
        ("package_name=match", "package_name 'match' is a Python keyword"),
        ("package_name=fastapi", "package_name 'fastapi' would shadow a dependency"),
        ("package_name=faststream", "package_name 'faststream' would shadow a dependency"),
        ("package_name=sqlmodel", "package_name 'sqlmodel' would shadow a dependency"),
        ("package_name=alembic", "package_name 'alembic' would shadow a dependency"),
        ("package_name=tests", "package_name 'tests' would shadow a dependency"),
        ("package_name=typing", "package_name 'typing' would shadow the standard library"),
        ("service_slug=json", "service_slug 'json' would shadow the standard library"),
        ("service_name=   ", "service_name must not be empty"),
        ("python_version=3.9", "python_version '3.9' is unsupported"),
    ],
)
def test_bad_answer_is_one_clear_line_and_creates_nothing(tmp_path: Path, answer: str, message: str) -> None:
    result = bake_cli(tmp_path, answer)
    assert result.returncode != 0
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("ERROR: ")]
    assert error_lines == [f"ERROR: {message}"] or any(message in line for line in error_lines), result.stderr
    assert list(tmp_path.iterdir()) == []


def test_unknown_broker_is_refused_in_one_line(tmp_path: Path) -> None:
    result = bake_cli(tmp_path, "broker=activemq")
    assert result.returncode != 0
    assert "activemq" in result.stderr
    assert "rabbitmq" in result.stderr  # names the valid choices
    assert result.stderr.count("Traceback") == 0, result.stderr
    assert list(tmp_path.iterdir()) == []


HOSTILE = {
    "service_name": 'Evil "Quote" \\ Service\nwith \'newline\'',
    "description": 'Says "hi"\\n and \\ backslashes; """triple""" \'\'\'single\'\'\' $HOME # not a comment',
    "author": 'O\'Brien "the" \\ Author',
}


def test_hostile_free_text_round_trips(tmp_path: Path) -> None:
    project = bake(tmp_path, service_slug="evil-service", **HOSTILE)
    pyproject = tomllib.loads((project / "pyproject.toml").read_text())
    assert pyproject["project"]["description"] == HOSTILE["description"]
    assert pyproject["project"]["authors"] == [{"name": HOSTILE["author"]}]
    about = ast.parse((project / "src/evil_service/about.py").read_text())
    values = {
        node.target.id: ast.literal_eval(node.value)
        for node in about.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None
    }
    assert values["SERVICE_NAME"] == HOSTILE["service_name"]
    assert values["DESCRIPTION"] == HOSTILE["description"]
    recorded = json.loads((project / ".cookiecutter.json").read_text())["cookiecutter"]
    assert recorded["service_name"] == HOSTILE["service_name"]
    assert recorded["description"] == HOSTILE["description"]
    yaml.safe_load((project / "docker-compose.yml").read_text())
    for path in project.rglob("*.py"):
        ast.parse(path.read_text(), filename=str(path))


def test_answers_are_recorded_for_updates(tmp_path: Path) -> None:
    project = bake(tmp_path, broker="nats", include_example=False)
    recorded = json.loads((project / ".cookiecutter.json").read_text())["cookiecutter"]
    assert recorded["broker"] == "nats"
    assert recorded["include_example"] is False
    assert recorded["package_name"] == "order_service"
