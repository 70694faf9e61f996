"""Sending side of the shm backend (protocol and segment lifetime: ``shm.py``).

Per receiver address: one control connection and its ring of ``slots`` segments. A
``send`` waits for a free slot, copies the payload into it (the one copy) while hashing
it, and writes one ``chunk`` frame; from the slot wait to the frame write nothing awaits,
so a cancelled send either sent its whole frame or nothing, and frames never interleave.
A slot is reused only after the receiver's ``verdict`` for it. A resend stages the
caller's payload again and claims the checksum of the first staging: a payload that
changed in between fails rather than passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

import structlog
import xxhash

from common.transfer import control, wire
from common.transfer.base import TransferError
from common.transfer.pooled import InFlight, PooledSender
from common.transfer.shm import MAX_SLOTS, VERSION, parse_shm_address, read_verdict
from common.transfer.shm_segment import SHM_DIR, Segment, new_prefix, segment_name, unlink_prefix

log = structlog.get_logger("pdserve.transfer")

_ALIGN = 1 << 20
_PIECE = 256 << 10


def stage(destination: memoryview, source: memoryview) -> int:
    """Copy ``source`` to the start of ``destination``; return its ``wire.checksum``.

    In cache-sized pieces, each hashed right after it is copied, while it is still in
    cache: the end-to-end check then costs little on top of the copy.
    """
    if source.nbytes <= _PIECE:
        destination[: source.nbytes] = source
        return wire.checksum(source)
    hasher = xxhash.xxh3_64()  # seed 0, as wire.checksum
    for start in range(0, source.nbytes, _PIECE):
        piece = source[start : start + _PIECE]
        destination[start : start + piece.nbytes] = piece
        hasher.update(piece)
    return hasher.intdigest()


class _Ring:
    """One connection's slots. ``error`` is set once the connection is gone.

    Free slots are reused most recently released first, so that only as many segments
    grow large as large chunks are in flight together.
    """

    def __init__(self, directory: str, slots: int, min_bytes: int, budget: int) -> None:
        self.directory, self.prefix, self.min_bytes = directory, new_prefix(), min_bytes
        self.segments: list[Segment | None] = [None] * slots
        self.generations = [0] * slots
        self.sizes = [0] * slots
        self.free = list(range(slots - 1, -1, -1))
        self.budget, self.in_flight = budget, 0
        self.changed = asyncio.Event()
        self.error: str | None = None
        self.created = 0
        self.waiting: dict[int, InFlight] = {}  # slot -> the chunk written there

    async def acquire(self, nbytes: int) -> int:
        """A free slot, once ``nbytes`` more fit in the budget (or nothing is in flight)."""
        while self.error is None and not (
            self.free and (not self.in_flight or self.in_flight + nbytes <= self.budget)
        ):
            self.changed.clear()
            await self.changed.wait()
        if self.error is not None:
            raise TransferError(self.error)
        slot = self.free.pop()
        self.sizes[slot] = nbytes
        self.in_flight += nbytes
        return slot

    def release(self, slot: int, verdict: wire.Verdict | None = None) -> None:
        """Free ``slot``; hand the chunk written there its ``verdict``."""
        if slot >= len(self.segments) or slot in self.free:
            raise control.ControlError(f"verdict for slot {slot}, which is not in flight")
        self.free.append(slot)
        self.in_flight -= self.sizes[slot]
        self.changed.set()
        attempt = self.waiting.pop(slot, None)
        if attempt is not None:
            attempt.answered(verdict)

    async def drained(self) -> None:
        """Return once every slot is released (or the connection is gone)."""
        while self.error is None and len(self.free) < len(self.segments):
            self.changed.clear()
            await self.changed.wait()

    def place(self, slot: int, nbytes: int) -> Segment:
        """The slot's segment, replaced by a larger one if ``nbytes`` does not fit."""
        segment = self.segments[slot]
        if segment is not None and segment.size >= nbytes:
            return segment
        if segment is not None:
            segment.unlink()  # the receiver removed it already unless it never mapped it
            segment.close()
            self.segments[slot] = None
        self.generations[slot] += 1
        size = max(self.min_bytes, -(-nbytes // _ALIGN) * _ALIGN)
        name = segment_name(self.prefix, slot, self.generations[slot])
        segment = self.segments[slot] = Segment.create(self.directory, name, size)
        self.created += 1
        return segment

    def destroy(self, reason: str) -> None:
        self.error = self.error or reason
        self.changed.set()
        waiting, self.waiting = self.waiting, {}
        for attempt in waiting.values():
            attempt.lost(self.error)
        for segment in self.segments:
            if segment is not None:
                segment.close()
        self.segments = [None] * len(self.segments)
        unlink_prefix(self.directory, self.prefix)


class _Connection:
    def __init__(self, reader, writer, ring: _Ring) -> None:
        self.reader, self.writer, self.ring = reader, writer, ring
        self.task: asyncio.Task | None = None

    def usable(self) -> bool:
        return self.ring.error is None and not self.writer.is_closing()


class ShmSender(PooledSender):
    """KVSender over shared memory, for receivers on this host.

    Per receiver: up to ``slots`` chunks and ``max_in_flight_bytes`` in flight (a larger
    chunk goes alone), in as many segments, each at least ``min_segment_bytes`` and
    grown to the largest chunk sent through it. ``segments_created`` counts segments
    made so far.
    """

    def __init__(
        self,
        *,
        slots: int = 16,
        max_in_flight_bytes: int = 64 << 20,
        min_segment_bytes: int = 1 << 20,
        directory: str = SHM_DIR,
        connect_timeout_s: float = 5.0,
    ) -> None:
        if not 1 <= slots <= MAX_SLOTS:
            raise ValueError(f"slots must be in [1, {MAX_SLOTS}], got {slots}")
        if min(max_in_flight_bytes, min_segment_bytes, connect_timeout_s) <= 0:
            raise ValueError(
                "max_in_flight_bytes, min_segment_bytes and connect_timeout_s must be > 0"
            )
        self._slots, self._min_bytes, self._directory = slots, min_segment_bytes, directory
        super().__init__()
        self._budget = max_in_flight_bytes
        self._connect_timeout_s = connect_timeout_s
        self._created_before = 0

    @property
    def segments_created(self) -> int:
        return self._created_before + sum(c.ring.created for c in self._pool.values())

    @property
    def connections(self) -> int:
        return sum(conn.usable() for conn in self._pool.values())

    async def _post(self, attempt: InFlight) -> None:
        chunk, view, address = attempt.chunk, attempt.view, attempt.address
        request_id = chunk.request_id
        conn = await self._connection(address)
        ring = conn.ring
        slot = await ring.acquire(view.nbytes)
        try:
            segment = ring.place(slot, view.nbytes)
        except OSError as exc:
            ring.release(slot)
            raise TransferError(
                f"cannot stage {view.nbytes} bytes in shared memory: {exc}", request_id
            ) from exc
        staged = stage(segment.view, view)
        if attempt.claimed is None:
            attempt.claimed = staged
        frame = control.pack(
            "chunk",
            request_id=request_id,
            layer=chunk.layer,
            block_ids=chunk.block_ids,
            checksum=attempt.claimed,
            attempt=chunk.attempt,
            slot=slot,
            segment=segment.name,
            offset=0,
            length=view.nbytes,
        )
        ring.waiting[slot] = attempt
        await self._write(address, conn, request_id, frame)

    async def _write_end(self, address, message) -> None:
        kind = "finish" if isinstance(message, wire.Finish) else "abort"
        frame = control.pack(kind, **message._asdict())
        await self._write(address, await self._connection(address), message.request_id, frame)

    async def close(self) -> None:
        """Close every connection once the receiver has taken what was sent on it (at
        most ``connect_timeout_s`` each), then remove every segment."""
        self._closed = True
        await self._stop_resending()
        pool, self._pool = self._pool, {}
        for conn in pool.values():
            self._created_before += conn.ring.created
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(conn.ring.drained(), self._connect_timeout_s)
            conn.writer.close()
            with contextlib.suppress(OSError):
                await conn.writer.wait_closed()
            if conn.task is not None:
                conn.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await conn.task
            conn.ring.destroy("sender closed")

    async def _write(self, address: str, conn: _Connection, rid: str, frame: bytes) -> None:
        if not conn.usable():
            self._drop(address, conn)
            raise TransferError(f"connection to {address} broke: {conn.ring.error}", rid)
        conn.writer.write(frame)
        try:
            await conn.writer.drain()
        except OSError as exc:
            self._drop(address, conn)
            raise TransferError(f"connection to {address} broke: {exc!r}", rid) from exc

    async def _dial(self, address: str) -> _Connection:
        host, port = parse_shm_address(address)
        if port == 0:
            raise ValueError(f"cannot connect to port 0: {address!r}")
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                reader, writer = await asyncio.open_connection(host, port)
        except OSError as exc:  # TimeoutError is an OSError
            raise TransferError(f"cannot connect to {address}: {exc!r}") from exc
        sock = writer.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = _Connection(
            reader, writer, _Ring(self._directory, self._slots, self._min_bytes, self._budget)
        )
        # The prefix goes out before any segment exists, so the receiver can always
        # remove what this connection leaves behind.
        writer.write(control.pack("hello", v=VERSION, prefix=conn.ring.prefix))
        conn.task = asyncio.create_task(self._read_verdicts(address, conn))
        return conn

    async def _read_verdicts(self, address: str, conn: _Connection) -> None:
        try:
            while True:
                conn.ring.release(*read_verdict(await control.read(conn.reader)))
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            reason = f"receiver connection lost ({type(exc).__name__})"
        except control.ControlError as exc:
            log.warning("kv_transfer.protocol_error", backend="shm", error=str(exc))
            reason = f"receiver protocol error: {exc}"
        self._drop(address, conn, reason)

    def _drop(self, address: str, conn: _Connection, reason: str = "connection dropped") -> None:
        if self._pool.get(address) is conn:
            del self._pool[address]
            self._created_before += conn.ring.created
        conn.writer.transport.abort()
        conn.ring.destroy(reason)
