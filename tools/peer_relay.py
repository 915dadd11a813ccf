"""The relay's CPU per row beside a peer's, measured in one run: txoutbox through FastStream.

A measurement for template developers, not a test. Issue 35 set the relay's CPU target from
txoutbox 0.2.2, a plain relay (one claim statement, the stored bytes published through
FastStream's own ``broker.publish``, one ``UPDATE ... WHERE id = ANY($1)`` per batch). This
script measures, round after round in one run on the same machine:

* the raw publish: FastStream's ``broker.publish`` of N relay-shaped messages, 64 in flight
  (``make bench``'s reference);
* this service's relay: one worker process draining N rows written by the real unit of work;
* txoutbox: its ``PostgresStorage`` and ``Relay`` draining N rows that hold the same body and the
  same signed headers, each published with the same ``broker.publish`` call, in this process.

Each is CPU time of the process doing the work divided by the messages; the counting consumer
runs in a process of its own for all three. Run it inside a baked default service, with
PostgreSQL and RabbitMQ on loopback::

    make bake
    cd build/bake/order-service && make install
    ../../../.venv/bin/uv pip install --python .venv/bin/python 'txoutbox[postgres]==0.2.2'
    OUTBOX_KIT_TEST_CONTAINER=order_service.container:build_container \\
        .venv/bin/python ../../../tools/peer_relay.py --messages 10000 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import asyncpg
from outbox_kit.runtime.container import build_transport
from outbox_kit.testing import bench
from outbox_kit.transports.settings import EndpointNames
from txoutbox import OutboxMessage, Relay, RelayConfig
from txoutbox.adapters.postgres import PostgresStorage

TABLE = "peer_outbox"


async def peer_drain(base: bench.Target, count: int) -> bench.Outcome:
    """txoutbox draining ``count`` rows of the relay's exact message shape, CPU of this process."""
    target = base.fresh()
    settings = target.settings()
    container = bench.bench_container(settings)
    bus = settings.message_bus
    names = EndpointNames(settings.application.namespace, bus.preserve_default_endpoint_names)
    transport = build_transport(bus, names, container.registry(), container.signer())
    messages = bench.prebuilt(container, count, keys=0)
    pool = await asyncpg.create_pool(target.database.replace("+asyncpg", ""), min_size=2, max_size=4)
    storage = PostgresStorage(pool, table=TABLE)
    await storage.create_schema()
    await pool.execute(f"TRUNCATE {TABLE}")
    async with pool.acquire() as connection, connection.transaction():
        for envelope, headers in messages:
            await storage.insert(
                connection, names.channel(envelope.event_name), envelope.body, headers=headers
            )
    counter = await bench.receiver(target, count, "ticked", pipeline=False)
    broker: Any = transport.broker  # type: ignore[attr-defined]
    exchange = transport._exchange  # type: ignore[attr-defined]
    timeout = bus.publish_timeout_seconds

    # What a plain relay calls: FastStream's own publish of the stored bytes and headers.
    async def publish(message: OutboxMessage) -> None:
        await broker.publish(
            message.payload,
            exchange=exchange,
            routing_key=message.topic,
            persist=True,
            mandatory=True,
            headers=dict(message.headers),
            message_id=message.headers.get("x-message-id", str(message.id)),
            content_type="application/json",
            timeout=timeout,
        )

    relay = Relay(storage, publish, config=RelayConfig(batch_size=100, concurrency=bench.IN_FLIGHT))
    try:
        await transport.connect()
        started, cpu = time.time(), time.process_time()
        while (await relay.run_once()).claimed:
            pass
        relay_cpu = time.process_time() - cpu
        finished, summary = bench.parse_done(await counter.expect("done", bench.drain_timeout(count)))
        return bench.Outcome(count, finished - started, summary | {"relay_cpu_us": relay_cpu / count * 1e6})
    finally:
        await counter.stop()
        await transport.close()
        await pool.execute(f"DROP TABLE IF EXISTS {TABLE} CASCADE")
        await pool.close()
        await container.database().dispose()
        await bench.delete_topology(target, "ticked")


async def measure(count: int, rounds: int) -> dict[str, list[float]]:
    target = bench.Target(bench.DEFAULT_DATABASE)
    await bench.prepare(target)
    figures: dict[str, list[float]] = {"raw": [], "ours": [], "txoutbox": []}
    for number in range(1, rounds + 1):
        raw = await bench.raw_publish(target, count)
        ours = await bench.relay_drain(target, count)
        peer = await peer_drain(target, count)
        figures["raw"].append(raw.extra["publish_cpu_us"])
        figures["ours"].append(ours.extra["relay_cpu_us"])
        figures["txoutbox"].append(peer.extra["relay_cpu_us"])
        print(
            f"round {number}: CPU per message: raw publish {raw.extra['publish_cpu_us']:.0f} µs, "
            f"this relay {ours.extra['relay_cpu_us']:.0f} µs ({ours.rate:.0f}/s), "
            f"txoutbox {peer.extra['relay_cpu_us']:.0f} µs ({peer.rate:.0f}/s)",
            flush=True,
        )
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    figures = asyncio.run(measure(args.messages, args.rounds))
    ours, peer, raw = figures["ours"], figures["txoutbox"], figures["raw"]
    ratios = [a / b for a, b in zip(ours, peer, strict=True)]
    print(json.dumps({name: [round(v) for v in values] for name, values in figures.items()}))
    print(
        f"medians: raw publish {statistics.median(raw):.0f} µs, this relay {statistics.median(ours):.0f} µs, "
        f"txoutbox {statistics.median(peer):.0f} µs; this relay / txoutbox per round "
        f"{', '.join(f'{r:.2f}x' for r in ratios)} (median {statistics.median(ratios):.2f}x)"
    )


if __name__ == "__main__":
    main()
