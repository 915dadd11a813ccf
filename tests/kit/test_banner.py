"""The development banner shows calls that work: every context's ``examples`` when it has some,
the service's own surface otherwise; every path it names is one the app serves."""

from __future__ import annotations

import re

import pytest
from dependency_injector import providers
from fastapi import APIRouter
from outbox_kit.application.handlers import Module
from outbox_kit.runtime.app import create_app
from outbox_kit.runtime.container import OutboxContainer
from outbox_kit.runtime.server import print_banner
from outbox_kit.testing.fixtures import make_settings

pytestmark = pytest.mark.unit
BASE = "http://127.0.0.1:8000"


def container_of(*modules: Module) -> OutboxContainer:
    settings = make_settings("sqlite+aiosqlite:///unused.db")
    return OutboxContainer(settings=providers.Object(settings), modules=providers.Object(list(modules)))


def banner(container: OutboxContainer, capsys: pytest.CaptureFixture[str]) -> str:
    print_banner(container, BASE, with_worker=True)
    return capsys.readouterr().err


def widgets() -> Module:
    router = APIRouter(prefix="/widgets")
    router.add_api_route("", lambda: None, methods=["POST"])
    return Module(
        name="widgets",
        routers=(router,),
        examples=(
            'curl -s -X POST {base}/widgets {auth} -d \'{"name": "w"}\'',
            "curl -s {base}/widgets/<id>",
        ),
    )


def test_the_examples_of_every_context_are_shown_with_the_address_and_a_token(
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = banner(container_of(widgets()), capsys)
    posted = f'curl -s -X POST {BASE}/widgets -H "Authorization: Bearer $TOKEN" -d '
    assert posted + '\'{"name": "w"}\'' in text  # braces of a body are kept as they are
    assert f"curl -s {BASE}/widgets/<id>" in text
    assert "token --tenant acme --user alice --roles outbox-admin" in text
    assert f"{BASE}/readyz" not in text


def test_a_service_without_examples_shows_its_own_surface(capsys: pytest.CaptureFixture[str]) -> None:
    text = banner(container_of(Module(name="quiet")), capsys)
    assert f"curl -s {BASE}/readyz" in text
    assert f"curl -s {BASE}/admin/outbox/pending" in text


def test_every_path_the_banner_names_is_served(capsys: pytest.CaptureFixture[str]) -> None:
    container = container_of(Module(name="quiet"))
    served = set(create_app(container).openapi()["paths"]) | {"/docs"}
    named = {
        path.split("?")[0]
        for path in re.findall(rf"{re.escape(BASE)}(/[\w/<>?=-]*)", banner(container, capsys))
    }
    assert named
    assert named <= served, named - served
