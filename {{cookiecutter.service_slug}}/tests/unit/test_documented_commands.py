"""Every command the docs show is one this service has: each ``python -m <package> ...`` in the
code of README.md and docs/ parses with the CLI's own parser (placeholders filled in), and each
``make <target>`` is a target of the Makefile. Keep it passing when you edit the docs or the CLI.
(Running the commands is other tests' work: the CLI's, and the template's newcomer journey.)"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from outbox_kit.runtime.cli import build_parser

from {{ cookiecutter.package_name }}.settings import (
    Settings,
)

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Settings.__module__.partition(".")[0]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE = re.compile(r"```[a-z]*\n(.*?)```|`([^`\n]+)`", re.DOTALL)
SERVICE_COMMAND = re.compile(rf"python -m {PACKAGE}((?: [^\s`|#;)\\]+)*)")
MAKE_COMMAND = re.compile(r"(?:^|[\s(;])make ((?:[a-z][a-z-]* ?)+)", re.MULTILINE)
PLACEHOLDERS = {
    "<id>": "03f01712-eddc-49c4-bccd-489090de581d",
    "ID...": "03f01712-eddc-49c4-bccd-489090de581d",
    "ID": "03f01712-eddc-49c4-bccd-489090de581d",
}


def code_of(document: Path) -> list[str]:
    return [block or span for block, span in CODE.findall(document.read_text())]


def documented(pattern: re.Pattern[str]) -> list[tuple[str, str]]:
    found = []
    for document in DOCUMENTS:
        for code in code_of(document):
            for line in code.replace("\\\n", " ").splitlines():
                line = line.split(" #", 1)[0]  # noqa: PLW2901 (a shell comment is prose)
                found += [(document.name, match.group(1).strip()) for match in pattern.finditer(line)]
    return found


def makefile_targets() -> set[str]:
    return set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), re.MULTILINE))


def test_the_docs_show_service_commands_and_make_targets() -> None:
    """The patterns below still find the docs' commands (a test that checks nothing would pass)."""
    assert len(documented(SERVICE_COMMAND)) >= 5
    assert len(documented(MAKE_COMMAND)) >= 5


@pytest.mark.parametrize(("document", "command"), documented(SERVICE_COMMAND))
def test_every_documented_service_command_parses(document: str, command: str) -> None:
    arguments = [PLACEHOLDERS.get(word, word) for word in shlex.split(command)]
    if not arguments or "..." in arguments:
        return  # "outbox ...": a family of commands, not one
    try:
        build_parser(Settings).parse_args(arguments)
    except SystemExit as refused:
        pytest.fail(f"{document}: `python -m {PACKAGE} {command}` is refused by the CLI ({refused})")


@pytest.mark.parametrize(("document", "command"), documented(MAKE_COMMAND))
def test_every_documented_make_target_exists(document: str, command: str) -> None:
    unknown = [word for word in command.split() if word not in makefile_targets()]
    assert unknown == [], f"{document}: `make {command}` names targets the Makefile lacks"
