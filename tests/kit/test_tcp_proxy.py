"""The tests' TCP proxy cuts its line at once, whatever the Python: since 3.12.1
``Server.wait_closed()`` waits for the open connections, so a proxy that awaited it before
closing them hung every test that cut a line (and with it the generated CI on 3.12 and 3.13)."""

from __future__ import annotations

import asyncio

import pytest
from outbox_kit.testing.harness import tcp_proxy

pytestmark = pytest.mark.unit


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(1024):
        writer.write(data)
        await writer.drain()
    writer.close()


async def _line_gone(reader: asyncio.StreamReader) -> bool:
    """End of stream, or a reset (a frozen line dropped with bytes unread answers with RST)."""
    try:
        return await asyncio.wait_for(reader.read(1024), 5) == b""
    except ConnectionResetError:
        return True


@pytest.mark.parametrize("frozen", [False, True], ids=["flowing", "frozen"])
async def test_cut_drops_open_connections_and_returns(frozen: bool) -> None:
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with tcp_proxy("127.0.0.1", port) as proxy:
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            writer.write(b"ping")
            await writer.drain()
            assert await asyncio.wait_for(reader.read(4), 5) == b"ping"
            if frozen:
                proxy.freeze()
                writer.write(b"held")
                await writer.drain()
            await asyncio.wait_for(proxy.cut(), 5)  # hung for good on 3.12.1+ before the fix
            assert await _line_gone(reader)
            writer.close()
    finally:
        server.close()
        await server.wait_closed()
