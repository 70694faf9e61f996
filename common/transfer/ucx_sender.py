"""Sending side of the ucx backend (protocol and configuration: ``ucx.py``).

One endpoint per receiver address and a lock per endpoint, so the tagged messages of
two calls never interleave. A call cancelled or failing part-way through a message
aborts the endpoint: the receiver then fails the transfers it carried. A task per
endpoint receives the verdicts, which come back in the order the chunks went out.

Connecting to an address where nothing listens any more takes the whole
``connect_timeout_s``: ucxx does not report the refused connection, it waits for the
peer's handshake.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib

import structlog

from common.transfer import wire
from common.transfer.base import TransferError
from common.transfer.frame_reader import VERDICT_BATCH
from common.transfer.pooled import InFlight, PooledSender
from common.transfer.ucx import BATCH_LENGTH, load_ucxx, parse_ucx_address

log = structlog.get_logger("pdserve.transfer")


class _Connection:
    __slots__ = ("ep", "lock", "broken", "verdicts", "task")

    def __init__(self, ep) -> None:
        self.ep, self.lock, self.broken = ep, asyncio.Lock(), False
        # The chunks sent and not answered yet, in send order.
        self.verdicts: collections.deque[InFlight] = collections.deque()
        self.task: asyncio.Task | None = None

    def usable(self) -> bool:
        return not (self.broken or self.ep.closed)

    def fail_waiting(self, reason: str) -> None:
        while self.verdicts:
            self.verdicts.popleft().lost(reason)


class UcxSender(PooledSender):
    """KVSender over UCX, one endpoint per receiver address. Raises BackendUnavailable
    if ucxx cannot be imported."""

    def __init__(self, *, connect_timeout_s: float = 5.0) -> None:
        if connect_timeout_s <= 0:
            raise ValueError("connect_timeout_s must be > 0")
        self._ucxx = load_ucxx()
        super().__init__()
        self._connect_timeout_s = connect_timeout_s

    @property
    def connections(self) -> int:
        return sum(conn.usable() for conn in self._pool.values())

    async def _post(self, attempt: InFlight) -> None:
        view = attempt.view
        if attempt.claimed is None:
            attempt.claimed = wire.checksum(view)
        chunk = attempt.chunk._replace(checksum=attempt.claimed)
        head = wire.encode(chunk, view.nbytes, checked=True)
        await self._write(attempt.address, chunk.request_id, head, view, attempt)

    async def _write_end(self, address, message) -> None:
        await self._write(address, message.request_id, wire.encode(message))

    async def close(self) -> None:
        self._closed = True
        await self._stop_resending()
        pool, self._pool = self._pool, {}
        for conn in pool.values():
            conn.broken = True
            try:
                async with asyncio.timeout(2.0):
                    await conn.ep.close()  # flushes what is queued, then tells the peer
            except (TimeoutError, self._ucxx.exceptions.UCXError):
                conn.ep.abort()
            if conn.task is not None:
                conn.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await conn.task
            conn.fail_waiting("sender closed")

    async def _write(
        self, address: str, rid: str, head: bytes, payload=None, attempt: InFlight | None = None
    ) -> None:
        """Send one message; a chunk's ``attempt`` then waits for its verdict."""
        parts = [head] if payload is None or not payload.nbytes else [head, payload]
        for _ in range(3):  # another call may break the connection while we queue for it
            conn = await self._connection(address)
            async with conn.lock:
                if not conn.usable():
                    self._drop(address, conn)
                    continue
                if attempt is not None:
                    conn.verdicts.append(attempt)
                try:
                    # Both posted at once, in order (tasks start in creation order).
                    await asyncio.gather(*(conn.ep.send(part) for part in parts))
                except BaseException as exc:
                    # Part of a message may be out.
                    self._drop(address, conn, f"connection to {address} broke: {exc!r}")
                    if isinstance(exc, self._ucxx.exceptions.UCXError):
                        raise TransferError(f"connection to {address} broke: {exc!r}", rid) from exc
                    raise
            return
        raise TransferError(f"connection to {address} kept breaking", rid)

    async def _read_verdicts(self, address: str, conn: _Connection) -> None:
        buffer = bytearray(BATCH_LENGTH.size + VERDICT_BATCH * wire.MAX_VERDICT_BYTES)
        try:
            while True:
                await conn.ep.recv(buffer)
                if conn.broken:
                    return
                (length,) = BATCH_LENGTH.unpack_from(buffer)
                end = BATCH_LENGTH.size + length
                verdicts, parsed = wire.split_verdicts(buffer, BATCH_LENGTH.size, end)
                if parsed != end:
                    raise wire.WireError("a batch of verdicts ends mid-verdict")
                for verdict in verdicts:
                    if not conn.verdicts:
                        raise wire.WireError("a verdict for no chunk")
                    conn.verdicts.popleft().answered(verdict)
        except wire.WireError as exc:
            log.warning("kv_transfer.protocol_error", backend="ucx", error=str(exc))
            reason = f"receiver protocol error: {exc}"
        except Exception as exc:  # UCXError, or what ucxx raises on a closed endpoint
            reason = f"connection to {address} lost before the receiver's verdict: {exc!r}"
        self._drop(address, conn, reason)

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
        conn = _Connection(ep)
        conn.task = asyncio.create_task(self._read_verdicts(address, conn))
        return conn

    def _drop(self, address: str, conn: _Connection, reason: str = "connection dropped") -> None:
        conn.broken = True
        if self._pool.get(address) is conn:
            del self._pool[address]
        if not conn.ep.closed:
            conn.ep.abort()
        conn.fail_waiting(reason)
