"""Sending side of the ucx backend (protocol and configuration: ``ucx.py``).

One endpoint per receiver address and its run of messages not posted yet (framing:
``ucx.py``). A call adds its whole message to the run, with nothing awaited in between,
so the messages of two calls never interleave and a cancelled call added all of its
message or none of it; a run and the large payload that ends it are posted together, in
order. Sends are not waited for: ``send`` returns once its chunk is in the run (or
posted), so that the caller hashes the next chunk while this one travels and the
receiver always has the next payload to take; per endpoint, at most
``max_in_flight_bytes`` is posted and not sent yet. A send that fails aborts the
endpoint: the chunks waiting for their verdicts there are lost, and the receiver fails
the transfers it carried. A task per endpoint receives the verdicts, which come back in
the order the chunks went out.

Connecting to an address where nothing listens any more takes the whole
``connect_timeout_s``: ucxx does not report the refused connection, it waits for the
peer's handshake.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools

import structlog

from common.address import dial_target
from common.transfer import wire
from common.transfer.base import TransferError
from common.transfer.connections import InFlight, StreamSender
from common.transfer.frame_reader import VERDICT_BATCH
from common.transfer.ucx import (
    BATCH_LENGTH,
    INLINE_BYTES,
    RUN_BYTES,
    SCHEME,
    Pacer,
    load_ucxx,
    receive,
)

log = structlog.get_logger("pdserve.transfer")


class _Connection:
    __slots__ = (
        "ep",
        "broken",
        "verdicts",
        "task",
        "run",
        "run_bytes",
        "posting",
        "sending",
        "sent",
        "pacer",
    )

    def __init__(self, ep) -> None:
        self.ep, self.broken = ep, False
        # The chunks sent and not answered yet, in send order.
        self.verdicts: collections.deque[InFlight] = collections.deque()
        self.task: asyncio.Task | None = None
        self.run: list = []  # the parts of the messages not posted yet
        self.run_bytes = 0
        self.posting: asyncio.Handle | None = None  # the run's posting at the next turn
        self.sending = 0  # bytes posted and not sent yet
        self.sent = asyncio.Event()  # set when a send ends
        self.pacer = Pacer(lambda: bool(self.verdicts))  # verdicts due: read them soon

    def usable(self) -> bool:
        return not (self.broken or self.ep.closed)

    def fail_waiting(self, reason: str) -> None:
        while self.verdicts:
            self.verdicts.popleft().lost(reason)


class UcxSender(StreamSender):
    """KVSender over UCX, one endpoint per receiver address. Raises BackendUnavailable
    if ucxx cannot be imported. Per receiver, at most ``max_in_flight_bytes`` of payload
    is posted and not sent yet (a larger chunk goes alone)."""

    def __init__(
        self, *, connect_timeout_s: float = 5.0, max_in_flight_bytes: int = 64 << 20
    ) -> None:
        if connect_timeout_s <= 0 or max_in_flight_bytes <= 0:
            raise ValueError("connect_timeout_s and max_in_flight_bytes must be > 0")
        self._ucxx = load_ucxx()
        super().__init__()
        self._connect_timeout_s = connect_timeout_s
        self._budget = max_in_flight_bytes

    async def close(self) -> None:
        self._closed = True
        await self._stop_resending()
        conns, self._conns = self._conns, {}
        for address, conn in conns.items():
            self._post_run(address, conn)
            try:
                async with asyncio.timeout(2.0):
                    while conn.sending and conn.usable():  # what was posted goes first
                        conn.sent.clear()
                        await conn.sent.wait()
                    conn.broken = True
                    await conn.ep.close()  # then tells the peer
            except (TimeoutError, self._ucxx.exceptions.UCXError):
                conn.broken = True
                conn.ep.abort()
            if conn.task is not None:
                conn.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await conn.task
            conn.fail_waiting("sender closed")

    async def _write(
        self, address: str, rid: str, head: bytes, payload=None, attempt: InFlight | None = None
    ) -> None:
        """Add one message to the connection's run, once the bytes posted to ``address``
        and not sent yet leave room for its payload (or there are none); a chunk's
        ``attempt`` then waits for its verdict."""
        nbytes = 0 if payload is None else payload.nbytes
        inline = payload is not None and nbytes <= INLINE_BYTES
        for _ in range(3):  # another call may break the connection while we queue for it
            conn = await self._connection(address)
            if conn.usable() and conn.sending and conn.sending + nbytes > self._budget:
                self._post_run(address, conn)
                while conn.usable() and conn.sending and conn.sending + nbytes > self._budget:
                    conn.sent.clear()
                    await conn.sent.wait()
            if not conn.usable():
                self._drop(address, conn)
                continue
            if attempt is not None:
                conn.verdicts.append(attempt)
                conn.pacer.wake()
            size = len(head) + (nbytes if inline else 0)
            if conn.run and conn.run_bytes + size > RUN_BYTES:
                self._post_run(address, conn)
            conn.run.append(head)
            if inline and nbytes:
                conn.run.append(payload)  # copied once, when the run is joined
            conn.run_bytes += size
            if not inline:  # a FINISH or an ABORT (the sender waits), or a large payload
                self._post_run(address, conn, payload)
            elif conn.run_bytes >= RUN_BYTES:
                self._post_run(address, conn)
            elif conn.posting is None:
                loop = asyncio.get_running_loop()
                conn.posting = loop.call_soon(self._post_run, address, conn)
            return
        raise TransferError(f"connection to {address} kept breaking", rid)

    def _post_run(self, address: str, conn: _Connection, payload=None) -> None:
        """Post the connection's run, then ``payload`` (its last message's), if any."""
        if conn.posting is not None:
            conn.posting.cancel()
            conn.posting = None
        run, size = conn.run, conn.run_bytes
        conn.run, conn.run_bytes = [], 0
        if conn.broken or not run:
            return
        parts = [b"".join([BATCH_LENGTH.pack(size), *run])]
        if payload is not None:
            parts.append(payload)
        nbytes = sum(memoryview(part).nbytes for part in parts)
        conn.sending += nbytes
        # Posted in order: tasks start in creation order.
        sending = asyncio.gather(*(conn.ep.send(part) for part in parts))
        sending.add_done_callback(functools.partial(self._sent, address, conn, nbytes))

    def _sent(self, address: str, conn: _Connection, nbytes: int, sending: asyncio.Future) -> None:
        conn.sending -= nbytes
        conn.sent.set()
        exc = None if sending.cancelled() else sending.exception()
        if (sending.cancelled() or exc is not None) and not conn.broken:
            # Part of a message may be out.
            self._drop(address, conn, f"connection to {address} broke: {exc!r}")

    async def _read_verdicts(self, address: str, conn: _Connection) -> None:
        buffer = bytearray(BATCH_LENGTH.size + VERDICT_BATCH * wire.MAX_VERDICT_BYTES)
        try:
            while True:
                await receive(conn.ep, buffer, conn.pacer)
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
        host, port = dial_target(address, SCHEME)
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
        conn.sent.set()  # wakes the calls waiting for room: they find it broken
        self._post_run(address, conn)  # only forgets it: the connection is broken
        if self._conns.get(address) is conn:
            del self._conns[address]
        if not conn.ep.closed:
            conn.ep.abort()
        conn.fail_waiting(reason)
