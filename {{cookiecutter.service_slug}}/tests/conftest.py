"""The service's fixtures: the kit's (``outbox_kit.testing.fixtures``, a plugin loaded by
``-p`` in ``pyproject.toml``: services, databases, settings, containers, callers; its docstring
says how skips, isolation and hermeticity work), adapted to this service: a fresh database gets
this service's migrations, a container is this service's ``build_container``."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from outbox_kit.runtime import cli
from outbox_kit.runtime.settings import ServiceSettings
from outbox_kit.testing.fixtures import in_thread

from {{ cookiecutter.package_name }}.__main__ import PROJECT_ROOT
from {{ cookiecutter.package_name }}.container import (
    Container,
    build_container,
)


def migrate(url: str) -> None:
    """This service's migrations, to the head, on ``url``."""
    in_thread(cli.upgrade, PROJECT_ROOT, url)


@pytest.fixture(scope="session")
def migrate_database() -> Callable[[str], None]:
    return migrate


@pytest.fixture(scope="session")
def container_builder() -> Callable[[ServiceSettings], Container]:
    return build_container
