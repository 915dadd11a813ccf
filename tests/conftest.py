"""Shared bakes: each option combination is generated once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from .support import bake

VARIANTS: dict[str, dict[str, object]] = {
    "default": {},
    "kafka": {"broker": "kafka"},
    "nats": {"broker": "nats"},
    "redis": {"broker": "redis"},
    "no-example": {"include_example": False},
}


@pytest.fixture(scope="session")
def bakes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every variant baked once (cheap: cookiecutter renders in well under a second)."""
    root = tmp_path_factory.mktemp("bakes")
    return {name: bake(root / name, **answers) for name, answers in VARIANTS.items()}
