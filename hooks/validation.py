"""The rules every cookiecutter answer must satisfy: one module, used twice.

1. As a Jinja extension (``_extensions`` in cookiecutter.json): at a terminal, each answer is
   checked as soon as it is given (``refuse_at_once``, called by the next prompt's default); and
   the private answer ``__answers_valid`` renders through the ``validate_answers`` filter right
   after the prompts. A bad answer prints one ``ERROR:`` line per problem and exits with status 1
   *before* anything is generated (cookiecutter would otherwise print a traceback after a failed
   hook).
2. From ``pre_gen_project.py``, for paths that skip the prompts (``--replay``).

Standard library only.
"""

from __future__ import annotations

import json
import keyword
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

BROKERS = ("rabbitmq", "kafka", "nats", "redis")
PYTHON_VERSIONS = ("3.11", "3.12", "3.13")
MAX_NAME_LENGTH = 40
MAX_TEXT_LENGTH = 500
SLUG_PATTERN = re.compile(r"[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*")
PACKAGE_PATTERN = re.compile(r"[a-z][a-z0-9_]*")
# A generated package must not shadow the standard library or a dependency of the service
# (an `import fastapi` would then import the service itself), nor a folder of the project.
# The render tier checks this list against every module the baked service installs.
DEPENDENCY_NAMES = frozenset(
    {
        "# the kit (the framework, vendored in kit/) and folders of the generated project",
        "aio_pika",
        "aiokafka",
        "aiormq",
        "aiosqlite",
        "alembic",
        "annotated_doc",
        "annotated_types",
        "anyio",
        "app",
        "asgiref",
        "ast_serialize",
        "async_timeout",
        "asyncpg",
        "build",
        "certifi",
        "cffi",
        "cfgv",
        "charset_normalizer",
        "click",
        "conftest",
        "coverage",
        "cryptography",
        "dependency_injector",
        "dist",
        "distlib",
        "docs",
        "dotenv",
        "execnet",
        "fast_depends",
        "fastapi",
        "faststream",
        "filelock",
        "google",
        "greenlet",
        "grimp",
        "h11",
        "hatchling",
        "httpcore",
        "httpx",
        "hypothesis",
        "identify",
        "idna",
        "importlinter",
        "iniconfig",
        "jwt",
        "kit",
        "librt",
        "mako",
        "markdown_it",
        "markupsafe",
        "mdurl",
        "migrations",
        "multidict",
        "mypy",
        "mypy_extensions",
        "mypyc",
        "nats",
        "nodeenv",
        "opentelemetry",
        "outbox_kit",
        "packaging",
        "pamqp",
        "pathspec",
        "pip",
        "pkg_resources",
        "platformdirs",
        "pluggy",
        "pre_commit",
        "pre_commit_hooks",
        "prometheus_client",
        "prometheus_fastapi_instrumentator",
        "propcache",
        "py",
        "pycparser",
        "pydantic",
        "pydantic_core",
        "pydantic_settings",
        "pygments",
        "pytest",
        "pytest_asyncio",
        "pytest_cov",
        "pytest_timeout",
        "python_discovery",
        "redis",
        "requests",
        "rich",
        "ruamel",
        "ruff",
        "sentry_sdk",
        "setuptools",
        "sortedcontainers",
        "sqlalchemy",
        "sqlmodel",
        "src",
        "starlette",
        "test",
        "tests",
        "typing_extensions",
        "typing_inspection",
        "urllib3",
        "uv",
        "uvicorn",
        "virtualenv",
        "watchfiles",
        "wheel",
        "wrapt",
        "xdist",
        "yaml",
        "yarl",
    }
)


def _shadowed(name: str) -> str | None:
    if name in sys.stdlib_module_names:
        return "the standard library"
    if name in DEPENDENCY_NAMES:
        return "a dependency or a folder of the project"
    return None


def check_identifier(label: str, value: object, *, allow_hyphen: bool) -> str | None:
    """None when ``value`` is a usable slug (``allow_hyphen``) or package name."""
    if not isinstance(value, str) or not value:
        return f"{label} must not be empty"
    if len(value) > MAX_NAME_LENGTH:
        return f"{label} {value!r} is longer than {MAX_NAME_LENGTH} characters"
    if allow_hyphen and not SLUG_PATTERN.fullmatch(value):
        return (
            f"{label} {value!r} must be lowercase letters and digits, words joined by single "
            "'-' or '_', starting with a letter"
        )
    if not allow_hyphen and not PACKAGE_PATTERN.fullmatch(value):
        return (
            f"{label} {value!r} must be a lowercase Python identifier "
            "(letters, digits, '_', starting with a letter)"
        )
    as_module = value.replace("-", "_")
    if keyword.iskeyword(as_module) or keyword.issoftkeyword(as_module):
        return f"{label} {value!r} is a Python keyword"
    shadowed = _shadowed(as_module)
    return f"{label} {value!r} would shadow {shadowed}; choose another name" if shadowed else None


def check_text(label: str, value: object, *, required: bool) -> str | None:
    if not isinstance(value, str):
        return f"{label} must be text"
    if required and not value.strip():
        return f"{label} must not be empty"
    if len(value) > MAX_TEXT_LENGTH:
        return f"{label} is longer than {MAX_TEXT_LENGTH} characters"
    if any(0xD800 <= ord(character) <= 0xDFFF for character in value):
        return f"{label} holds an unpaired surrogate; it is not valid text"
    if holds_template_syntax(value):
        return f"{label} {value!r} {HOLDS_TEMPLATE_SYNTAX}"
    return None


TEMPLATE_MARKERS = ("{{", "{%", "{#")
# Joined, not escaped in an f-string: the escapes once printed a stray `}` after `{#`.
HOLDS_TEMPLATE_SYNTAX = (
    f"holds template syntax ({', '.join(TEMPLATE_MARKERS[:-1])} or {TEMPLATE_MARKERS[-1]}); remove it"
)


def holds_template_syntax(text: str) -> bool:
    """Cookiecutter renders a ``--no-input`` or ``--replay`` answer as a Jinja template: ``{{ 7*7 }}``
    would become ``49`` and an unbalanced ``{% raw %}`` a traceback. No answer needs the syntax."""
    return any(marker in text for marker in TEMPLATE_MARKERS)


def check_choice(label: str, value: object, choices: tuple[str, ...]) -> str | None:
    if value in choices:
        return None
    return f"{label} {value!r} is not one of: {', '.join(choices)}"


ANSWER_CHECKS: dict[str, Callable[[object], str | None]] = {
    "service_name": lambda value: check_text("service_name", value, required=True),
    "description": lambda value: check_text("description", value, required=False),
    "author": lambda value: check_text("author", value, required=False),
    "service_slug": lambda value: check_identifier("service_slug", value, allow_hyphen=True),
    "package_name": lambda value: check_identifier("package_name", value, allow_hyphen=False),
    "broker": lambda value: check_choice("broker", value, BROKERS),
    "python_version": lambda value: check_choice("python_version", value, PYTHON_VERSIONS),
    "include_example": lambda value: (
        None if isinstance(value, bool) else f"include_example {value!r} must be true or false"
    ),
}


def validate(answers: Mapping[str, Any]) -> list[str]:
    """One message per invalid answer; empty when every answer is valid."""
    found = [problem for name, check in ANSWER_CHECKS.items() if (problem := check(answers.get(name)))]
    if found and found[0] == "service_name must not be empty":
        # The slug and the package are derived from the name: one line says it all.
        found = [problem for problem in found if not problem.endswith("must not be empty")] + found[:1]
        found = list(dict.fromkeys(found))
    return found


def report(problems: list[str]) -> None:
    """Print the problems, one line each, and stop."""
    for problem in problems:
        print(f"ERROR: {problem}", file=sys.stderr)
    raise SystemExit(1)


def answering_at_a_terminal() -> bool:
    """A person is answering the prompts (not ``--no-input``, stdin a terminal)."""
    return sys.stdin.isatty() and "--no-input" not in sys.argv


def _refuse_at_once(answers: Mapping[str, Any], name: str) -> str:
    """Refuse the answer to ``name`` as soon as it is given, when a person is answering.

    Cookiecutter offers no validation hook per prompt, but it renders each prompt's default right
    after the previous answer, with the answers so far: the defaults in cookiecutter.json begin
    with this filter on the answer just given, so a bad answer stops the run with its one line
    before the next question, not after the last. Without a person at the prompts every answer
    is checked together at the end (``validate_answers``), so one run reports every problem.
    Renders as nothing."""
    if answering_at_a_terminal() and (problem := ANSWER_CHECKS[name](answers.get(name))):
        report([problem])
    return ""


def _validate_answers(answers: Mapping[str, Any]) -> str:
    problems = validate(answers)
    if problems:
        report(problems)
    return "yes"


def string_literal(value: object) -> str:
    """``value`` as a double-quoted literal that is valid TOML, Python and YAML alike.

    JSON's escapes (``\\"``, ``\\\\``, ``\\n``, ``\\uXXXX``) are a subset of all three, but
    Jinja's ``tojson`` writes characters beyond the BMP as surrogate pairs, which TOML rejects:
    keep them as themselves and escape only what must be escaped (DEL included, for TOML).
    """
    return json.dumps(str(value), ensure_ascii=False).replace("\x7f", "\\u007f")


def one_line(value: object) -> str:
    """``value`` with every control character turned into a space (headings, comments)."""
    return " ".join("".join(" " if ord(c) < 0x20 or ord(c) == 0x7F else c for c in str(value)).split())


# Keys that describe one run, not the answers: machine paths cookiecutter adds itself (and adds
# again on a replay), and where the template came from and at which commit (cruft records both in
# .cruft.json). Recorded here they changed with every template commit and every way of naming the
# template, and a template update then conflicted on this file (`cruft update` left a .rej).
NOT_RECORDED = frozenset({"_output_dir", "_repo_dir", "_checkout", "_template", "_commit"})


def recorded_answers(context: Mapping[str, Any]) -> str:
    """The whole context as a replay file (``cookiecutter --replay-file``, ``cruft link``)."""
    answers = {key: value for key, value in context.items() if key not in NOT_RECORDED}
    return json.dumps({"cookiecutter": answers}, indent=2, ensure_ascii=False)


try:  # cookiecutter always has Jinja; the hook that imports this module does not need it
    from jinja2.ext import Extension
except ImportError:  # pragma: no cover
    Extension = object  # type: ignore[assignment,misc]


class AnswerValidation(Extension):  # type: ignore[misc]
    """Adds the ``validate_answers`` filter (see the module docstring)."""

    def __init__(self, environment: Any) -> None:
        super().__init__(environment)
        environment.filters["validate_answers"] = _validate_answers
        environment.filters["refuse_at_once"] = _refuse_at_once
        environment.filters["string_literal"] = string_literal
        environment.filters["one_line"] = one_line
        environment.filters["recorded_answers"] = recorded_answers
        # The pre-generation hook runs as a script in the new project's folder; it loads these
        # same rules from this absolute path (the template's own path may be relative).
        environment.globals["answer_rules_path"] = str(Path(__file__).resolve())

    def preprocess(self, source: str, name: str | None, filename: str | None = None) -> str:
        """Refuse an answer that holds template syntax before cookiecutter evaluates it.

        Cookiecutter renders every variable's value with ``from_string`` (no template name), an
        answer given on the command line included. The template's own strings rendered that
        way (the derived defaults, the folder names, the hooks) all name ``cookiecutter``; an
        answer with the syntax and no such reference is stopped here with one line, where it
        would otherwise be evaluated or end in a traceback.
        """
        del filename
        if name is None and holds_template_syntax(source) and "cookiecutter" not in source:
            report([f"the answer {source!r} {HOLDS_TEMPLATE_SYNTAX}"])
        return source
