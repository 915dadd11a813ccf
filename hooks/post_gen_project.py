"""Finish the generated project: drop what the answers did not choose, create `.env`.

Standard library only, no package manager, no git: the hook must work on any machine that can
run cookiecutter. Every removal comes from one declarative table (answer -> paths), so adding an
optional part means adding one row, not another branch.

`.env` is `.env.example` with fresh random development secrets: the example publishes its values
(anyone who read the template knows them), so a service using them would accept tokens minted
by anyone. Each generated service gets its own JWT secret and message signing key instead.
"""

from __future__ import annotations

import json
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path

ANSWERS = json.loads(
    r'''{{ {
        "package_name": cookiecutter.package_name,
        "service_slug": cookiecutter.service_slug,
        "include_example": cookiecutter.include_example,
    } | tojson }}'''
)

PACKAGE = f"src/{ANSWERS['package_name']}"

# (answer, value that removes the paths, glob patterns relative to the project root)
REMOVALS: tuple[tuple[str, object, tuple[str, ...]], ...] = (
    (
        "include_example",
        False,
        (
            f"{PACKAGE}/contexts/orders",
            f"{PACKAGE}/contexts/notifications",
            f"{PACKAGE}/contracts/orders.py",
            "migrations/versions/*_example_contexts.py",
            "tests/*/test_example_*.py",
            "tests/architecture/message_names_example.txt",
        ),
    ),
)


def fresh_secret() -> str:
    """64 URL-safe characters (384 random bits): above what production asks of any HS key."""
    return secrets.token_urlsafe(48)


# setting -> its .env value, made from the published one (a signing key keeps its key id, which
# MESSAGE_BUS__SIGNING_KEY_ID names).
GENERATED_SECRETS: dict[str, Callable[[str], str]] = {
    "AUTH__JWT_SECRET": lambda _published: fresh_secret(),
    "MESSAGE_BUS__SIGNING_KEYS": lambda published: f"{published.partition(':')[0]}:{fresh_secret()}",
}


def write_env(example: Path, env: Path) -> None:
    """Copy ``example`` to ``env`` (readable by its owner only) with every secret generated."""
    lines = []
    for line in example.read_text(encoding="utf-8").splitlines(keepends=True):
        name, separator, published = line.rstrip("\n").partition("=")
        generated = separator and name in GENERATED_SECRETS
        lines.append(f"{name}={GENERATED_SECRETS[name](published)}\n" if generated else line)
    env.touch(mode=0o600)
    env.write_text("".join(lines), encoding="utf-8")


def remove(path: Path) -> None:
    """Delete a file or a whole folder; a path that is already gone is not an error."""
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def main() -> None:
    root = Path.cwd()
    for answer, value, paths in REMOVALS:
        if ANSWERS[answer] == value:
            for pattern in paths:
                for path in sorted(root.glob(pattern)):
                    remove(path)
    env, example = root / ".env", root / ".env.example"
    if example.exists() and not env.exists():
        write_env(example, env)
    print(
        f"\nCreated {ANSWERS['service_slug']}. Next steps:\n"
        f"  cd {ANSWERS['service_slug']}\n"
        "  make install    # .venv with the development tools (the versions of uv.lock)\n"
        "  make migrate    # create the embedded SQLite database\n"
        "  make run        # API + worker on http://127.0.0.1:8000 (SQLite, in-process bus)\n"
        "  make test       # the default test tiers\n"
    )


if __name__ == "__main__":
    main()
