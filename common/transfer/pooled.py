"""Per-address connections of a sender, dialled once and reused while they work."""

from __future__ import annotations

import asyncio
from typing import Any

from common.transfer.base import KVSender, TransferError


class PooledSender(KVSender):
    """A sender keeping one connection per receiver address.

    The subclass sets ``_pool`` (address -> connection), ``_dialing`` (address -> lock)
    and ``_closed``, and implements ``_dial(address)`` and ``_drop(address, conn)``;
    its connections answer ``usable()``. Concurrent callers for one address share a
    single dial; a broken connection is dropped and replaced on the next call.
    """

    _pool: dict[str, Any]
    _dialing: dict[str, asyncio.Lock]
    _closed: bool

    async def _dial(self, address: str) -> Any:
        raise NotImplementedError

    def _drop(self, address: str, conn: Any) -> None:
        raise NotImplementedError

    async def _connection(self, address: str) -> Any:
        conn = self._pool.get(address)
        if conn is not None and conn.usable():
            return conn
        async with self._dialing.setdefault(address, asyncio.Lock()):
            conn = self._pool.get(address)
            if conn is not None and conn.usable():
                return conn
            if conn is not None:
                self._drop(address, conn)
            if self._closed:
                raise TransferError("sender is closed")
            conn = self._pool[address] = await self._dial(address)
            return conn
