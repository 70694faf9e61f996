"""Sending side of the ucx backend (protocol and configuration: ``ucx.py``).

One endpoint per receiver address and a lock per endpoint, so the tagged messages of
two calls never interleave. A call cancelled or failing part-way through a message
aborts the endpoint: the receiver then fails the transfers it carried.

Connecting to an address where nothing listens any more takes the whole
``connect_timeout_s``: ucxx does not report the refused connection, it waits for the
peer's handshake.
"""

from __future__ import annotations

import asyncio

from common.transfer import wire
from common.transfer.base import TransferError
from common.transfer.pooled import PooledSender
from common.transfer.tcp import _byte_view
from common.transfer.ucx import load_ucxx, parse_ucx_address


class _Connection:
    __slots__ = ("ep", "lock", "broken")

    def __init__(self, ep) -> None:
        self.ep, self.lock, self.broken = ep, asyncio.Lock(), False

    def usable(self) -> bool:
        return not (self.broken or self.ep.closed)


class UcxSender(PooledSender):
    """KVSender over UCX, one endpoint per receiver address. Raises BackendUnavailable
    if ucxx cannot be imported."""

    def __init__(self, *, connect_timeout_s: float = 5.0) -> None:
        if connect_timeout_s <= 0:
            raise ValueError("connect_timeout_s must be > 0")
        self._ucxx = load_ucxx()
        self._connect_timeout_s = connect_timeout_s
        self._pool: dict[str, _Connection] = {}
        self._dialing: dict[str, asyncio.Lock] = {}
        self._closed = False

    @property
    def connections(self) -> int:
        return sum(conn.usable() for conn in self._pool.values())

    async def send(self, address, request_id, layer, block_ids, payload) -> None:
        view = _byte_view(payload)
        if not isinstance(block_ids, list | tuple):
            raise ValueError(f"block_ids must be a list of integers, got {block_ids!r}")
        chunk = wire.Chunk(request_id, layer, list(block_ids), wire.checksum(view))
        await self._write(address, request_id, wire.encode(chunk, view.nbytes), view)

    async def finish(self, address: str, request_id: str, num_chunks: int) -> None:
        await self._write(address, request_id, wire.encode(wire.Finish(request_id, num_chunks)))

    async def abort(self, address: str, request_id: str, reason: str) -> None:
        await self._write(address, request_id, wire.encode(wire.Abort(request_id, reason)))

    async def close(self) -> None:
        self._closed = True
        pool, self._pool = self._pool, {}
        for conn in pool.values():
            conn.broken = True
            try:
                async with asyncio.timeout(2.0):
                    await conn.ep.close()  # flushes what is queued, then tells the peer
            except (TimeoutError, self._ucxx.exceptions.UCXError):
                conn.ep.abort()

    async def _write(self, address: str, rid: str, head: bytes, payload=None) -> None:
        parts = [head] if payload is None or not payload.nbytes else [head, payload]
        for _ in range(3):  # another call may break the connection while we queue for it
            conn = await self._connection(address)
            async with conn.lock:
                if not conn.usable():
                    self._drop(address, conn)
                    continue
                try:
                    # Both posted at once, in order (tasks start in creation order).
                    await asyncio.gather(*(conn.ep.send(part) for part in parts))
                except BaseException as exc:
                    self._drop(address, conn)  # part of a message may be out
                    if isinstance(exc, self._ucxx.exceptions.UCXError):
                        raise TransferError(f"connection to {address} broke: {exc!r}", rid) from exc
                    raise
                return
        raise TransferError(f"connection to {address} kept breaking", rid)

    async def _dial(self, address: str) -> _Connection:
        host, port = parse_ucx_address(address)
        if port == 0:
            raise ValueError(f"cannot connect to port 0: {address!r}")
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                ep = await self._ucxx.create_endpoint(
                    host, port, connect_timeout=self._connect_timeout_s
                )
        except (TimeoutError, self._ucxx.exceptions.UCXError) as exc:
            raise TransferError(f"cannot connect to {address}: {exc!r}") from exc
        return _Connection(ep)

    def _drop(self, address: str, conn: _Connection) -> None:
        conn.broken = True
        if self._pool.get(address) is conn:
            del self._pool[address]
        if not conn.ep.closed:
            conn.ep.abort()
