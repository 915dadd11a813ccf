"""Outbox throughput against the raw broker, measured in one run on this machine.

``python -m bench.outbox_throughput [--transport rabbitmq|nats|redis|inprocess] [--messages N]
[--database URL]`` publishes N integration events twice:

* raw: straight through the FastStream broker to a subscriber that only counts (no database,
  no signature, no inbox): the ceiling the transport allows;
* outbox: committed as outbox rows (50 per transaction), claimed, published and consumed by
  the real consume pipeline (signature check, context restore, inbox row, handler) on the same
  transport.

It prints both rates and their ratio. Absolute numbers depend on the machine; the ratio is what
to compare between versions. Nothing here is asserted by the tests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from faststream import AckPolicy

from {{ cookiecutter.package_name }}.building_blocks.application.messages import (
    IntegrationEvent,
)
from {{ cookiecutter.package_name }}.building_blocks.kernel.request_context import (
    RequestContext,
    use_context,
)
from {{ cookiecutter.package_name }}.building_blocks.unit_of_work.unit_of_work import (
    UnitOfWork,
)
from {{ cookiecutter.package_name }}.container import (
    build_container,
)
from {{ cookiecutter.package_name }}.entrypoints import (
    migrations,
)
from {{ cookiecutter.package_name }}.settings import (
    Settings,
)

URLS = {
    "rabbitmq": "amqp://guest:guest@127.0.0.1:5672/",
    "nats": "nats://127.0.0.1:4222",
    "redis": "redis://127.0.0.1:6379",
    "inprocess": "",
}


class BenchTicked(IntegrationEvent, name="bench.ticked.v1"):
    number: int


async def raw_rate(transport: str, messages: int) -> float:
    """Messages per second straight through FastStream, publish to consume."""
    if transport == "inprocess":
        return float("nan")
    done = asyncio.Event()
    received = 0
    subject = f"bench-raw-{uuid.uuid4().hex[:8]}"
    broker: Any
    if transport == "rabbitmq":
        from faststream.rabbit import RabbitBroker  # noqa: PLC0415

        broker = RabbitBroker(URLS[transport])
        subscriber = broker.subscriber(subject, ack_policy=AckPolicy.ACK)
    elif transport == "nats":
        from faststream.nats import JStream, NatsBroker  # noqa: PLC0415

        broker = NatsBroker(URLS[transport])
        stream = JStream(subject.upper().replace("-", "_"), subjects=[subject])
        subscriber = broker.subscriber(subject, stream=stream, durable=subject, ack_policy=AckPolicy.ACK)
    else:
        from faststream.redis import RedisBroker, StreamSub  # noqa: PLC0415

        broker = RedisBroker(URLS[transport])
        subscriber = broker.subscriber(stream=StreamSub(subject, group=subject, consumer="bench"))

    @subscriber
    async def count(body: dict[str, Any]) -> None:
        nonlocal received
        del body
        received += 1
        if received == messages:
            done.set()

    async with broker:
        await broker.start()
        started = time.perf_counter()
        for number in range(messages):
            if transport == "nats":
                await broker.publish({"number": number}, subject, stream=stream.name)
            elif transport == "redis":
                await broker.publish({"number": number}, stream=subject)
            else:
                await broker.publish({"number": number}, subject, persist=True)
        await asyncio.wait_for(done.wait(), 300)
        return messages / (time.perf_counter() - started)


async def outbox_rate(transport: str, messages: int, database_url: str) -> float:
    """Messages per second from commit to the consumer's committed inbox row."""
    settings = Settings(
        _env_file=None,  # type: ignore[call-arg]
        application={"namespace": f"bench{uuid.uuid4().hex[:8]}"},
        database={"url": database_url},
        message_bus={
            "transport": transport,
            "url": URLS[transport],
            "enable_outbox": True,
            "enable_inbox": True,
            "signing_keys": "bench:bench-secret",
        },
        outbox={"batch_size": 100, "polling_interval_seconds": 1},
        logging={"level": "WARNING"},
    )
    container = build_container(settings)
    container.registry().register(BenchTicked)
    done = asyncio.Event()
    received = 0

    async def consume(event: BenchTicked, uow: UnitOfWork) -> None:
        nonlocal received
        del event, uow
        received += 1
        if received == messages:
            done.set()

    container.handlers().consume("bench.counter", BenchTicked, consume)
    await container.bus().start()
    await container.worker().start()
    try:
        started = time.perf_counter()
        with use_context(RequestContext(tenant_id="bench", user_id="bench", correlation_id="bench")):
            for first in range(0, messages, 50):
                async with container.units_of_work()() as uow:
                    for number in range(first, min(first + 50, messages)):
                        uow.enqueue(BenchTicked(number=number))
                    await uow.commit()
        await asyncio.wait_for(done.wait(), 600)
        return messages / (time.perf_counter() - started)
    finally:
        await container.worker().stop()
        await container.database().dispose()


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as folder:
        url = args.database or f"sqlite+aiosqlite:///{Path(folder) / 'bench.db'}"
        await asyncio.to_thread(migrations.upgrade, url)
        raw = await raw_rate(args.transport, args.messages)
        outbox = await outbox_rate(args.transport, args.messages, url)
    report = {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "transport": args.transport,
        "database": url.split(":", 1)[0],
        "messages": args.messages,
        "raw_per_second": round(raw, 1),
        "outbox_per_second": round(outbox, 1),
        "outbox_to_raw_ratio": round(outbox / raw, 3) if raw == raw else None,  # noqa: PLR0124 (NaN check)
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--transport", default="rabbitmq", choices=sorted(URLS))
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument(
        "--database", default="", help="a migrated-or-empty database URL; a temp SQLite file by default"
    )
    asyncio.run(main(parser.parse_args()))
