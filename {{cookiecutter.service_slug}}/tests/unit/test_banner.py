"""The development banner of ``run`` offers this service's contexts' ``examples``: every path it
names is one the app serves (the kit's tests cover the banner itself)."""

from __future__ import annotations

import re

import pytest
from outbox_kit.runtime.app import create_app
from outbox_kit.runtime.server import print_banner
from outbox_kit.testing.fixtures import make_settings

from {{ cookiecutter.package_name }}.container import (
    build_container,
)

pytestmark = pytest.mark.unit
BASE = "http://127.0.0.1:8000"


def test_every_path_the_banner_names_is_served(capsys: pytest.CaptureFixture[str]) -> None:
    container = build_container(make_settings("sqlite+aiosqlite:///unused.db"))
    served = set(create_app(container).openapi()["paths"]) | {"/docs"}
    print_banner(container, BASE, with_worker=True)
    named = {
        path.split("?")[0]
        for path in re.findall(rf"{re.escape(BASE)}(/[\w/<>?=-]*)", capsys.readouterr().err)
    }
    assert named
    assert named <= served, named - served
