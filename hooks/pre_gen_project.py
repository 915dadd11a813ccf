"""Validate every answer before cookiecutter writes a single file.

Answers are read as data: they are rendered through ``tojson`` into a raw string literal
(``tojson`` escapes every ``'``, so the JSON text cannot close the literal) and parsed with
``json.loads``. A quote, a backslash or a newline in a free-text answer can therefore never
break or inject into this hook. A bad answer prints one line naming the answer and the rule, and
exits with status 1, so cookiecutter creates nothing.
"""

from __future__ import annotations

import json
import keyword
import re
import sys

ANSWERS = json.loads(
    r'''{{ {
        "service_name": cookiecutter.service_name,
        "service_slug": cookiecutter.service_slug,
        "package_name": cookiecutter.package_name,
        "description": cookiecutter.description,
        "author": cookiecutter.author,
        "broker": cookiecutter.broker,
        "include_example": cookiecutter.include_example,
        "python_version": cookiecutter.python_version,
    } | tojson }}'''
)

BROKERS = ("rabbitmq", "kafka", "nats", "redis")
PYTHON_VERSIONS = ("3.11", "3.12", "3.13")

# Names a generated package or slug must not take: they would shadow the standard library or a
# dependency of the generated service (an `import fastapi` would then import the service).
DEPENDENCY_NAMES = frozenset(
    {
        "aio_pika", "aiokafka", "aiormq", "aiosqlite", "alembic", "anyio", "asyncpg",
        "dependency_injector", "fastapi", "faststream", "greenlet", "h11", "httpx", "importlinter",
        "jwt", "mako", "mypy", "nats", "prometheus_client", "pydantic", "pydantic_core",
        "pydantic_settings", "pytest", "pytest_asyncio", "redis", "ruff", "sqlalchemy",
        "sqlmodel", "starlette", "typing_extensions", "uvicorn", "yaml",
        "test", "tests", "src", "app", "migrations", "docs", "build", "dist",
    }
)
MAX_NAME_LENGTH = 60
SLUG_PATTERN = re.compile(r"[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*")
PACKAGE_PATTERN = re.compile(r"[a-z][a-z0-9_]*")


def _shadowed(name: str) -> str | None:
    if name in sys.stdlib_module_names:
        return "the standard library"
    if name in DEPENDENCY_NAMES:
        return "a dependency or a reserved project folder"
    return None


def _check_identifier(label: str, value: str, *, allow_hyphen: bool) -> str | None:
    pattern = SLUG_PATTERN if allow_hyphen else PACKAGE_PATTERN
    shape = (
        "lowercase letters and digits, words joined by single '-' or '_', starting with a letter"
        if allow_hyphen
        else "a lowercase Python identifier (letters, digits, '_', starting with a letter)"
    )
    if not value:
        return f"{label} must not be empty"
    if len(value) > MAX_NAME_LENGTH:
        return f"{label} {value!r} is longer than {MAX_NAME_LENGTH} characters"
    if not pattern.fullmatch(value):
        return f"{label} {value!r} must be {shape}"
    as_module = value.replace("-", "_")
    if keyword.iskeyword(as_module) or keyword.issoftkeyword(as_module):
        return f"{label} {value!r} is a Python keyword"
    shadowed = _shadowed(as_module)
    if shadowed:
        return f"{label} {value!r} would shadow {shadowed}; choose another name"
    return None


def _check_free_text(label: str, value: object, *, required: bool) -> str | None:
    if not isinstance(value, str):
        return f"{label} must be text"
    if required and not value.strip():
        return f"{label} must not be empty"
    if len(value) > 500:
        return f"{label} is longer than 500 characters"
    return None


def validate(answers: dict[str, object]) -> list[str]:
    """Return one message per invalid answer (empty when every answer is valid)."""
    problems = [
        _check_free_text("service_name", answers["service_name"], required=True),
        _check_free_text("description", answers["description"], required=False),
        _check_free_text("author", answers["author"], required=False),
        _check_identifier("service_slug", str(answers["service_slug"]), allow_hyphen=True),
        _check_identifier("package_name", str(answers["package_name"]), allow_hyphen=False),
    ]
    if answers["broker"] not in BROKERS:
        problems.append(f"broker {answers['broker']!r} is unknown; choose one of {', '.join(BROKERS)}")
    if answers["python_version"] not in PYTHON_VERSIONS:
        problems.append(
            f"python_version {answers['python_version']!r} is unsupported; "
            f"choose one of {', '.join(PYTHON_VERSIONS)}"
        )
    if not isinstance(answers["include_example"], bool):
        problems.append(f"include_example {answers['include_example']!r} must be true or false")
    return [p for p in problems if p]


def main() -> int:
    problems = validate(ANSWERS)
    for problem in problems:
        print(f"ERROR: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
