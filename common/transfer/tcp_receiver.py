"""Receiving side of the tcp backend (protocol and socket settings: ``tcp.py``).

A server whose per-connection protocol is a ``FrameReader`` (a ``BufferedProtocol``:
payloads are received straight into a reused buffer, which a ``StreamReader`` cannot
do), all connections feeding one ``TransferTable`` and answering each chunk on its
connection.
"""

from __future__ import annotations

import asyncio
import socket

from common.transfer.frame_reader import FrameReader
from common.transfer.table_receiver import TableReceiver
from common.transfer.tcp import SCHEME, SOCKET_BUFFER_BYTES, tune_socket


class TcpReceiver(TableReceiver):
    """KVReceiver over TCP. Give ``sink`` or a ``table`` shared with other receivers
    (``multi.py``), not both. ``dropped`` counts messages for request ids not live."""

    SCHEME = SCHEME

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *,
                 socket_buffer_bytes: int = SOCKET_BUFFER_BYTES, **common) -> None:
        """``common``: ``TableReceiver``'s sink, table and max_payload_bytes."""
        super().__init__(host, port, **common)
        self._buffer_bytes = socket_buffer_bytes
        self._server: asyncio.Server | None = None

    async def _listen(self) -> int:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(
            self._host, self._port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        family, type_, proto, _, sockaddr = infos[0]
        sock = socket.socket(family, type_, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            tune_socket(sock, self._buffer_bytes)
            sock.bind(sockaddr)
            sock.setblocking(False)
            self._server = await loop.create_server(self._new_reader, sock=sock, backlog=128)
        except BaseException:
            sock.close()
            raise
        return sock.getsockname()[1]

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for reader in list(self._connections):
            reader.abort()
        if self._server is not None:
            await self._server.wait_closed()

    def _new_reader(self) -> FrameReader:
        reader = FrameReader(self.table, self.max_payload, self._untrack)
        self._track(reader)
        return reader
