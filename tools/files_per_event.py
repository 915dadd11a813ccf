"""How many files one order event crosses, from ``POST /orders`` to the notifications handler.

A measurement for template developers, not a test: it runs inside a baked default service (the
example contexts, PostgreSQL and RabbitMQ on loopback). Copy it into the bake and run it::

    make bake
    cp tools/files_per_event.py build/bake/order-service/tests/integration/test_files_per_event.py
    cd build/bake/order-service && .venv/bin/python -m pytest -s -p no:cacheprovider \\
        tests/integration/test_files_per_event.py; rm tests/integration/test_files_per_event.py

It prints two counts over the kit's and the service's source files:

* every file any of whose functions runs between the request and the handler's end, less those
  that also run in an idle window of the same service (helpers such as text checks included);
* the files on the call stack at the event's five steps (the repository's ``persist``, the unit
  of work's outbox write, the in-process handler, the broker publish, the consumer's handler):
  the path a reader follows.
"""

from __future__ import annotations

import asyncio
import sys
from types import FrameType
from typing import Any

import httpx
import pytest
from order_service.container import build_container
from order_service.contexts.notifications import application as notifications
from outbox_kit.testing.fixtures import SERVICE_URLS, live_server, make_settings, token_for

ORDER = {"customer_id": "c-9", "lines": [{"sku": "PEN", "quantity": 3, "unit_price": "1.50"}]}
ROOTS = ("kit/src/outbox_kit/", "src/order_service/")
STEPS = {
    ("src/order_service/contexts/orders/infrastructure.py", "persist"),
    ("kit/src/outbox_kit/persistence/unit_of_work.py", "write"),
    ("src/order_service/contexts/orders/application.py", "announce_order_placed"),
    ("kit/src/outbox_kit/transports/rabbit.py", "publish"),
    ("src/order_service/contexts/notifications/application.py", "on_order_placed"),
}


def ours(filename: str) -> str | None:
    for root in ROOTS:
        if (at := filename.find(root)) >= 0:
            return filename[at:]
    return None


def recorder(ran: set[str], stacks: set[str]) -> Any:
    def hook(frame: FrameType, event: str, _: object) -> None:
        if event != "call" or (here := ours(frame.f_code.co_filename)) is None:
            return
        ran.add(here)
        if (here, frame.f_code.co_name) in STEPS:
            caller: FrameType | None = frame
            while caller is not None:
                if (name := ours(caller.f_code.co_filename)) is not None:
                    stacks.add(name)
                caller = caller.f_back

    return hook


@pytest.mark.rabbitmq
async def test_files_one_event_crosses(postgres_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    arrived = asyncio.Event()
    handler = notifications.on_order_placed

    async def on_order_placed(event: Any, uow: Any) -> None:
        await handler(event, uow)
        arrived.set()

    monkeypatch.setattr(notifications, "on_order_placed", on_order_placed)
    settings = make_settings(
        postgres_url, message_bus={"transport": "rabbitmq", "url": SERVICE_URLS["rabbitmq"]}
    )
    container = build_container(settings)
    headers = {"Authorization": f"Bearer {token_for(container, 'acme', 'alice')}"}
    idle: set[str] = set()
    ran: set[str] = set()
    on_stack: set[str] = set()
    try:
        async with live_server(container) as base, httpx.AsyncClient(base_url=base) as client:
            await asyncio.sleep(1.0)
            sys.setprofile(recorder(idle, set()))
            await asyncio.sleep(0.5)
            sys.setprofile(recorder(ran, on_stack))
            await client.post("/orders", headers=headers, json=ORDER)
            await asyncio.wait_for(arrived.wait(), 10)
            sys.setprofile(None)
    finally:
        sys.setprofile(None)
        await container.bus().delete_topology()  # type: ignore[attr-defined]
        await container.database().dispose()
    crossed = sorted(ran - idle)
    print(f"\nfiles whose code runs for the event: {len(crossed)}", *crossed, sep="\n  ")
    print(f"files on the call stack at its steps: {len(on_stack)}", *sorted(on_stack), sep="\n  ")
    assert on_stack <= set(crossed)
