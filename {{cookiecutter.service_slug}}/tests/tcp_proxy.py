"""A TCP proxy between the service and a real server, so a test can cut the line.

Stopping a shared server would break every other test on the machine; cutting the proxy makes
the server vanish for one container only, which is what an outage looks like from the service.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class TcpProxy:
    """Forwards every connection on ``port`` to ``target_host:target_port`` until cut."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self._target = (target_host, target_port)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._flowing = asyncio.Event()
        self._flowing.set()
        self.port = 0

    def freeze(self) -> None:
        """Stop forwarding bytes but keep every socket open: a half-open line, as after a
        failover behind a load balancer. New connections are accepted and hang too."""
        self._flowing.clear()

    def thaw(self) -> None:
        self._flowing.set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        """Refuse new connections and drop the open ones (the port stays reserved).

        The open connections are closed before ``wait_closed()``: since Python 3.12.1 it waits
        for them, so awaiting it first hung for as long as a client kept its line."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for writer in list(self._writers):
            writer.close()
        self._writers.clear()
        if server is not None:
            await server.wait_closed()

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self._writers.add(client_writer)  # before the upstream connect, so a cut meanwhile drops it
        try:
            server_reader, server_writer = await asyncio.open_connection(*self._target)
        except OSError:
            client_writer.close()
            self._writers.discard(client_writer)
            return
        if client_writer not in self._writers:  # cut while connecting upstream
            server_writer.close()
            return
        self._writers.add(server_writer)
        await asyncio.gather(
            self._pipe(client_reader, server_writer), self._pipe(server_reader, client_writer)
        )

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(65536):
                await self._flowing.wait()
                writer.write(data)
                await writer.drain()
        writer.close()
        self._writers.discard(writer)


@contextlib.asynccontextmanager
async def tcp_proxy(target_host: str, target_port: int) -> AsyncIterator[TcpProxy]:
    proxy = TcpProxy(target_host, target_port)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.cut()
