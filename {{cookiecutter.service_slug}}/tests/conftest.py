"""The service's fixtures: the kit's (``outbox_kit.testing.fixtures``, a plugin loaded by
``-p`` in ``pyproject.toml``: services, databases, settings, containers, callers; its docstring
says how skips, isolation and hermeticity work), adapted to this service: a fresh database gets
this service's migrations, a container is this service's ``build_container``; and a live server
of this service's app."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

import pytest
from fastapi import APIRouter
from outbox_kit.runtime import cli
from outbox_kit.runtime.settings import ServiceSettings
from outbox_kit.testing.fixtures import free_port, in_thread

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


@asynccontextmanager
async def live_server(
    container: Container, *, with_worker: bool = True, routers: Sequence[APIRouter] = ()
) -> AsyncIterator[str]:
    """The app on a real uvicorn server (lifespan included), on a free port of this loop;
    ``routers`` stand for a context a user adds later (the app's edge must cover it too)."""
    import uvicorn
    from outbox_kit.runtime.app import create_app
    from outbox_kit.runtime.server import server_config

    app = create_app(container, with_worker=with_worker)
    for router in routers:
        app.include_router(router)
    port = free_port()
    # The configuration `run` and `api` serve with (time limits for slow clients included).
    config = server_config(app, container.settings().api, container.settings().logging.level)
    config.host, config.port = "127.0.0.1", port
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        for _ in range(200):
            if server.started:
                break
            if task.done():
                task.result()
            await asyncio.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 20)


def token_for(
    container: Container, tenant: str = "acme", user: str = "alice", roles: tuple[str, ...] = ()
) -> str:
    return container.tokens().mint(user_id=user, tenant_id=tenant, roles=roles)
