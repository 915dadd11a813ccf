"""Run the Alembic migrations of the service (``migrate`` and the test fixtures)."""

from __future__ import annotations

import os
from pathlib import Path

from alembic import command
from alembic.config import Config

PROJECT_ROOT = Path(__file__).resolve().parents[3]


def alembic_config(database_url: str | None = None) -> Config:
    """The project's ``alembic.ini`` (``ALEMBIC_CONFIG``, the working directory, or the
    project root of this checkout), pointed at ``database_url`` when given."""
    candidates = [os.environ.get("ALEMBIC_CONFIG"), "alembic.ini", str(PROJECT_ROOT / "alembic.ini")]
    path = next((Path(c) for c in candidates if c and Path(c).is_file()), None)
    if path is None:
        msg = "alembic.ini not found: run from the project root or set ALEMBIC_CONFIG"
        raise FileNotFoundError(msg)
    config = Config(str(path))
    config.set_main_option("script_location", str(path.parent / "migrations"))
    if database_url:
        config.attributes["database_url"] = database_url
    return config


def upgrade(database_url: str | None = None, revision: str = "head") -> None:
    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str | None = None, revision: str = "base") -> None:
    command.downgrade(alembic_config(database_url), revision)


def check(database_url: str | None = None) -> None:
    """Raise when the models and the migrations disagree (``alembic check``)."""
    command.check(alembic_config(database_url))
