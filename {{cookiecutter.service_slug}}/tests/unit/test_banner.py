"""The development banner shows calls that work: the example's order and notification calls when
the service has them, its own surface otherwise; every path it names is one the app serves."""

from __future__ import annotations

import re

import pytest
from fastapi import APIRouter, FastAPI
from outbox_kit.testing.fixtures import make_settings

from {{ cookiecutter.package_name }}.container import (
    build_container,
)
from {{ cookiecutter.package_name }}.entrypoints import (
    serving,
)
from {{ cookiecutter.package_name }}.entrypoints.app import (
    create_app,
)

pytestmark = pytest.mark.unit
BASE = "http://127.0.0.1:8000"


def banner(app: FastAPI, capsys: pytest.CaptureFixture[str]) -> str:
    settings = make_settings("sqlite+aiosqlite:///unused.db")
    serving.print_banner(settings, app, BASE, with_worker=True)
    return capsys.readouterr().err


def test_a_service_with_orders_shows_the_order_and_notification_calls(
    capsys: pytest.CaptureFixture[str],
) -> None:
    app = FastAPI()
    orders = APIRouter(prefix="/orders")
    orders.add_api_route("", lambda: None, methods=["POST"])
    app.include_router(orders)
    text = banner(app, capsys)
    assert f"curl -s -X POST {BASE}/orders" in text
    assert f"curl -s {BASE}/notifications?order_id=<id>" in text


def test_a_service_without_them_shows_its_own_surface(capsys: pytest.CaptureFixture[str]) -> None:
    text = banner(FastAPI(), capsys)
    assert f"curl -s {BASE}/readyz" in text
    assert "/orders" not in text


def test_every_path_the_banner_names_is_served(capsys: pytest.CaptureFixture[str]) -> None:
    app = create_app(build_container(make_settings("sqlite+aiosqlite:///unused.db")))
    served = set(app.openapi()["paths"]) | {"/docs"}
    text = banner(app, capsys)
    named = {path.split("?")[0] for path in re.findall(rf"{re.escape(BASE)}(/[\w/<>?=-]*)", text)}
    assert named
    assert named <= served, named - served
