"""This service's broker names: the namespace, or this service's slug when it is unset (the
names themselves are the kit's tests)."""

from __future__ import annotations

import pytest
from outbox_kit.testing.fixtures import settings_of

from {{ cookiecutter.package_name }}.about import (
    SERVICE_SLUG,
)
from {{ cookiecutter.package_name }}.container import (
    build_container,
)
from {{ cookiecutter.package_name }}.settings import (
    Settings,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("namespace", "expected"), [("", SERVICE_SLUG), ("tenant-eu", "tenant-eu")])
def test_the_bus_uses_the_namespace_or_falls_back_to_the_slug(
    sqlite_url: str, namespace: str, expected: str
) -> None:
    settings = settings_of(
        Settings,  # the service's slug is the fallback
        sqlite_url,
        application={"namespace": namespace},
        message_bus={"transport": "redis", "url": "redis://127.0.0.1:1"},  # never connected
    )
    names = build_container(settings).bus().names  # type: ignore[attr-defined]
    assert names.exchange() == f"{expected}.events"
