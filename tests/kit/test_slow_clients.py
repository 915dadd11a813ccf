"""Slow clients are timed out (the service as a real process, raw sockets): a request head that
trickles in, a connection that sends nothing, and a body that trickles in each lose their
connection (or get a 408) within ``API__HEADER_READ_TIMEOUT_SECONDS`` /
``API__BODY_READ_TIMEOUT_SECONDS``, while a normal request meanwhile is served. Before, uvicorn
had no such limit: each of them held a connection (and, for a body, a request task) for ever."""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import pytest
from outbox_kit.testing.fixtures import free_port, service_process, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]
LIMIT = 1.0  # seconds, for the head and for the body
GENEROUS = 8.0  # what "within the limit" may take on a loaded machine
TRICKLE_FOR = 15.0  # a slow client keeps sending this long unless the server closes first


async def trickle(port: int, head: bytes, pieces: bytes) -> tuple[bytes, float]:
    """Send ``head`` at once, then ``pieces`` one byte every 0.2 s, while reading: what the server
    answered before it closed, and when (seconds after connecting). Fails if it never closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    started = time.monotonic()
    closed_at: list[float] = []

    chunks: list[bytes] = []

    async def read_all() -> bytes:
        # A byte the client sent just as the server closed is answered with a reset: that too is
        # the server closing the connection.
        with contextlib.suppress(ConnectionResetError):
            while chunk := await reader.read(65536):
                chunks.append(chunk)
        closed_at.append(time.monotonic() - started)
        return b"".join(chunks)

    answer = asyncio.create_task(read_all())
    try:
        writer.write(head)
        await writer.drain()
        for byte in pieces:
            # Stop sending once the server answered: a byte after its close would reset the line.
            if chunks or answer.done() or time.monotonic() - started > TRICKLE_FOR:
                break
            with contextlib.suppress(ConnectionError):
                writer.write(bytes([byte]))
                await writer.drain()
            await asyncio.sleep(0.2)
        received = await asyncio.wait_for(answer, GENEROUS)
    except TimeoutError:
        pytest.fail("the server never closed the connection of a slow client")
    finally:
        answer.cancel()
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    return received, closed_at[0]


async def test_slow_heads_idle_connections_and_slow_bodies_are_cut_while_others_are_served(
    sqlite_url: str,
) -> None:
    port = free_port()
    limits = {"API__HEADER_READ_TIMEOUT_SECONDS": str(LIMIT), "API__BODY_READ_TIMEOUT_SECONDS": str(LIMIT)}
    with service_process(sqlite_url, "api", "--port", str(port), **limits) as process:
        await asyncio.to_thread(wait_for, f"http://127.0.0.1:{port}/livez", process)
        slow_head = trickle(port, b"GET /livez HTTP/1.1\r\n", b"X-Slow: " + b"a" * 200)
        idle = trickle(port, b"", b"")
        slow_body = trickle(
            port,
            b"POST /admin/outbox/dead-letters/replay HTTP/1.1\r\nHost: t\r\n"
            b"Content-Type: application/json\r\nContent-Length: 200\r\n\r\n",
            b"{" + b" " * 199,
        )

        async def served_meanwhile() -> list[int]:
            await asyncio.sleep(0.5)  # the slow clients are connected and sending
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                return [(await client.get("/livez")).status_code for _ in range(3)]

        head, nothing, body, normal = await asyncio.gather(slow_head, idle, slow_body, served_meanwhile())
    assert normal == [200, 200, 200]
    for _, after in (head, nothing, body):
        assert LIMIT * 0.9 <= after < GENEROUS, (head, nothing, body)
    assert head[0].startswith(b"HTTP/1.1 408"), head  # a head begun and never finished
    assert nothing[0] == b""  # nothing sent: closed without an answer
    body_answer = body[0]
    assert body_answer.startswith(b"HTTP/1.1 408"), body_answer
    assert b"API__BODY_READ_TIMEOUT_SECONDS" in body_answer
