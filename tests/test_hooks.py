"""Tier 2, hooks: a bad answer is one readable line and creates nothing; hostile free text
round-trips into valid generated files."""

from __future__ import annotations

import ast
import json
import os
import pty
import select
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import yaml

from .support import TEMPLATE, bake, load_answer_rules

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
        ("package_name=outbox_kit", "package_name 'outbox_kit' would shadow a dependency"),
        ("package_name=typing", "package_name 'typing' would shadow the standard library"),
        ("service_slug=json", "service_slug 'json' would shadow the standard library"),
        ("service_name=   ", "service_name must not be empty"),
        ("package_name=click", "package_name 'click' would shadow a dependency"),
        ("package_name=conftest", "package_name 'conftest' would shadow a dependency"),
        ("service_slug=" + "a" * 41, "service_slug '" + "a" * 41 + "' is longer than 40 characters"),
        ("python_version=3.9", "python_version '3.9' is not one of: 3.11, 3.12, 3.13"),
        ("broker=activemq", "broker 'activemq' is not one of: rabbitmq, kafka, nats, redis"),
    ],
)
def test_bad_answer_is_one_clear_line_and_creates_nothing(tmp_path: Path, answer: str, message: str) -> None:
    result = bake_cli(tmp_path, answer)
    assert result.returncode != 0
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("ERROR: ")]
    assert any(line.startswith(f"ERROR: {message}") for line in error_lines), result.stderr
    assert "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "answer",
    [
        "service_name={{ 7*7 }}",
        "description={% raw %}",
        "author=O'Brien {# a comment #}",
        "service_name=Billing {% if true %}",
    ],
)
def test_an_answer_with_template_syntax_is_one_line_not_evaluated(tmp_path: Path, answer: str) -> None:
    """Cookiecutter renders command-line answers as templates: ``{{ 7*7 }}`` would become 49 and
    an unbalanced ``{% raw %}`` a traceback. Both are one line, and nothing is generated."""
    result = bake_cli(tmp_path, answer)
    assert result.returncode == 1
    # Spelled out, not an f-string: the line once ended in a stray `}` that an f-string copy of
    # the hook's own escapes repeated.
    expected = "ERROR: the answer " + repr(answer.split("=", 1)[1]) + " holds template syntax "
    assert result.stderr.strip().splitlines() == [expected + "({{, {% or {#); remove it"]
    assert list(tmp_path.iterdir()) == []


def test_a_replayed_answer_with_template_syntax_names_the_markers_without_a_stray_brace() -> None:
    """The rules the pre-generation hook applies to a replayed answer say the same thing."""
    rules = load_answer_rules()
    message = rules.check_text("author", "O'Brien {# x", required=False)
    assert message == 'author "O\'Brien {# x" holds template syntax ({{, {% or {#); remove it'


def test_the_pre_gen_hook_rejects_replayed_answers(tmp_path: Path) -> None:
    """``--replay`` skips the prompts; the pre-generation hook still refuses a bad answer."""
    replay = tmp_path / "replay.json"
    answers = {
        "service_name": "X",
        "service_slug": "x-service",
        "package_name": "class",
        "description": "",
        "author": "",
        "broker": "nats",
        "include_example": True,
        "python_version": "3.11",
        "__broker_url": "",
        "__answers_valid": "yes",
        "_extensions": ["hooks.validation.AnswerValidation"],
        "_copy_without_render": [],
        "_template": str(TEMPLATE),
    }
    replay.write_text(json.dumps({"cookiecutter": answers}))
    output = tmp_path / "out"
    command = [
        sys.executable,
        "-m",
        "cookiecutter",
        "--replay-file",
        str(replay),
        "--output-dir",
        str(output),
        str(TEMPLATE),
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False, timeout=120)
    assert result.returncode != 0
    assert "ERROR: package_name 'class' is a Python keyword" in result.stderr
    assert not (output / "x-service").exists()


HOSTILE = {
    "service_name": "Evil \"Quote\" \\ Service\nwith 'newline' $(shell touch PWNED) \U0001f680 \\",
    "description": 'Says "hi"\\n and \\ backslashes; """triple""" \'\'\'single\'\'\' $HOME # not a comment',
    "author": 'O\'Brien "the" \\ Author \U0001f600\x7f',
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
    assert (project / "README.md").read_text().splitlines()[0].startswith("# Evil")
    # The Makefile names no free text: make parses it without running anything hidden in it.
    dry_run = subprocess.run(["make", "-n", "help"], cwd=project, capture_output=True, text=True, check=False)
    assert dry_run.returncode == 0, dry_run.stderr
    assert not (project / "PWNED").exists()


def test_the_recorded_answers_replay_to_the_same_project(tmp_path: Path) -> None:
    """``.cookiecutter.json`` is a complete replay file: regenerating from it changes nothing."""
    project = bake(tmp_path / "first", service_slug="evil-service", **HOSTILE)
    replayed = tmp_path / "second"
    command = [sys.executable, "-m", "cookiecutter", "--replay-file", str(project / ".cookiecutter.json")]
    result = subprocess.run(
        [*command, "--output-dir", str(replayed), str(TEMPLATE)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    for path in project.rglob("*"):
        if path.is_file() and path.name != ".env":  # .env holds fresh secrets on every generation
            twin = replayed / project.name / path.relative_to(project)
            assert path.read_bytes() == twin.read_bytes(), path
    assert (replayed / project.name / ".env").is_file()


def test_an_empty_service_name_is_one_line(tmp_path: Path) -> None:
    """The slug and the package are derived from the name: their emptiness is not repeated."""
    result = bake_cli(tmp_path, "service_name=")
    assert [line for line in result.stderr.splitlines() if line.startswith("ERROR")] == [
        "ERROR: service_name must not be empty"
    ]
    assert list(tmp_path.iterdir()) == []


def test_answers_are_recorded_for_updates(tmp_path: Path) -> None:
    project = bake(tmp_path, broker="nats", include_example=False)
    recorded = json.loads((project / ".cookiecutter.json").read_text())["cookiecutter"]
    assert recorded["broker"] == "nats"
    assert recorded["include_example"] is False
    assert recorded["package_name"] == "order_service"
    # Where the template came from, and at which commit, is cruft's to record (.cruft.json):
    # here it would change with every template commit and conflict on each update.
    assert not {"_template", "_commit", "_output_dir", "_repo_dir", "_checkout"} & set(recorded)


def answer_at_a_terminal(output: Path, answers: list[str], timeout: float = 60) -> tuple[int, str]:
    """Run cookiecutter in a pseudo-terminal as a person would, giving ``answers`` one per prompt
    (each sent when its prompt appears); return the exit status and everything the terminal showed."""
    controller, terminal = pty.openpty()
    command = [sys.executable, "-m", "cookiecutter", "--output-dir", str(output), str(TEMPLATE)]
    process = subprocess.Popen(command, stdin=terminal, stdout=terminal, stderr=terminal, close_fds=True)
    os.close(terminal)
    shown, pending = b"", list(answers)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([controller], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(controller, 4096)
            except OSError:  # the terminal closed: the process has ended
                break
            if not chunk:
                break
            shown += chunk
            if pending and shown.rstrip().endswith(b":"):
                os.write(controller, pending.pop(0).encode() + b"\n")
        elif process.poll() is not None:
            break
    os.close(controller)
    return process.wait(timeout=timeout), shown.decode(errors="replace")


def test_at_a_terminal_a_bad_answer_is_refused_before_the_next_prompt(tmp_path: Path) -> None:
    status, shown = answer_at_a_terminal(tmp_path, ["Orders", "Bad Slug", "orders", "orders"])
    assert status == 1, shown
    assert "ERROR: service_slug 'Bad Slug' must be lowercase letters" in shown, shown
    assert "Python package name" not in shown  # the next question was never asked
    assert "Traceback" not in shown
    assert list(tmp_path.iterdir()) == []


def test_at_a_terminal_good_answers_generate_the_service(tmp_path: Path) -> None:
    """The checks render as nothing: the defaults a person accepts are the usual ones."""
    status, shown = answer_at_a_terminal(tmp_path, ["Billing", "", "", "", "", "nats", "", ""])
    assert status == 0, shown
    recorded = json.loads((tmp_path / "billing" / ".cookiecutter.json").read_text())["cookiecutter"]
    assert (recorded["package_name"], recorded["description"], recorded["author"]) == (
        "billing",
        "A microservice with a transactional outbox and inbox.",
        "Your Name",
    )
    assert (recorded["broker"], recorded["python_version"], recorded["include_example"]) == (
        "nats",
        "3.11",
        True,
    )
