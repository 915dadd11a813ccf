"""Shared bakes: each option combination is generated once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from .support import bake, install

# The kit's own suite runs in the kit's environment (tests/test_kit.py), not in this one.
collect_ignore = ["kit"]

VARIANTS: dict[str, dict[str, object]] = {
    "default": {},
    "kafka": {"broker": "kafka"},
    "nats": {"broker": "nats"},
    "redis": {"broker": "redis"},
    "no-example": {"include_example": False},
    # The longest accepted name (40 characters) on the newest Python floor: imports must stay
    # within the line length and the code must stay clean under a newer ruff/mypy target.
    "long-name-py313": {"service_name": "Warehouse Inventory Reservations Service", "python_version": "3.13"},
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The long tests first, so `make test` (tests handed out one at a time) starts them first
    on both workers: collected late, one of them ran alone for minutes at the end while the other
    worker had nothing left."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


@pytest.fixture(scope="session")
def bakes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every variant baked once (cheap: cookiecutter renders in well under a second)."""
    root = tmp_path_factory.mktemp("bakes")
    return {name: bake(root / name, **answers) for name, answers in VARIANTS.items()}


@pytest.fixture(scope="session")
def shared_python(bakes: dict[str, Path]) -> Path:
    """One environment for the static checks: the dependency list has no template branches,
    so every variant type-checks against the same installed packages."""
    return install(bakes["default"])
