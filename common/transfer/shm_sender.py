"""Sending side of the shm backend (protocol and segment lifetime: ``shm.py``).

Per receiver address: one control connection and its ring of ``slots`` segments. A
``send`` waits for room in the ring, copies the payload there (the one copy) while
hashing it, and queues one ``chunk`` frame; from the wait to the queueing nothing
awaits, so a cancelled send either queued its whole frame or nothing, and frames never
interleave. A slot is reused only once the receiver's ``verdict`` for every chunk placed
in it came back. A resend stages the caller's payload again and claims the checksum of
the first staging: a payload that changed in between fails rather than passes.

Per-chunk costs are what limit small payloads (a 48 KiB chunk copies in ~3 µs), so:
- frames are corked until the event loop's next turn, or until the chunks they announce
  reach ``_FLUSH_BYTES`` (2 MiB): a run of small sends costs one write here, one wake-up
  and one batch of verdicts on the receiver. Each notice wakes the receiver, and on a
  busy 2-core machine a wake-up costs far more than the copy it announces (flushing at
  512 KiB took 2.7 receiver wake-ups for a 1.4 MiB request, 1.0 at 2 MiB);
- a BATCH's frame is the exception: it goes at once. Its chunks are all there is until
  the FINISH, and the receiver can copy them out while this side's Python gets to the
  FINISH (about 40 µs for a request's layers); that FINISH then finds the receiver
  awake, and its write costs 5 µs instead of the 25-60 µs of one that wakes it. A 1.4
  MB request: 5-6% sooner, 1,000 alternated transfers a pair;
- the chunk frame is binary (``shm.py``): no msgpack map per chunk;
- small chunks share a segment, one after another, so a request of small chunks takes a
  slot or two, not one each;
- verdicts are read in the connection's protocol callback, straight into the ring.
For large chunks the cost is memory traffic: a chunk of ``_WARM_BYTES`` or more lets the
verdicts that have come free their slots before the next chunk picks one, which is then
the slot just emptied, its segment still in cache (otherwise chunks go round as many
segments as the in-flight budget holds: 63 MiB for 9 MiB chunks).
"""

from __future__ import annotations

import asyncio
import contextlib
import operator
import socket

import structlog
import xxhash

from common.address import dial_target
from common.transfer import control, shm_control, wire
from common.transfer.base import TransferError
from common.transfer.connections import ConnectionSender, InFlight
from common.transfer.shm import (
    KNOWN_VERDICTS,
    MAX_SLOTS,
    SCHEME,
    VERSION,
    chunk_frame,
    read_verdict,
)
from common.transfer.shm_ring import Ring
from common.transfer.shm_segment import SHM_DIR
from kernels import cpu_copysum as copysum

log = structlog.get_logger("pdserve.transfer")

_PIECE = 256 << 10
_NBYTES = operator.attrgetter("nbytes")
_FLUSH_BYTES = 2 << 20
_WARM_BYTES = 4 << 20


def stage(destination: memoryview, source: memoryview) -> int:
    """Copy ``source`` to the start of ``destination``; return its ``wire.checksum``."""
    if source.nbytes <= _PIECE and (source.nbytes <= copysum.SHORT or copysum.kernel() is None):
        destination[: source.nbytes] = source
        return xxhash.xxh3_64_intdigest(source)
    return stage_many(destination, (source,))


def stage_many(destination: memoryview, sources) -> int:
    """Copy ``sources`` back to back to the start of ``destination``; return the
    checksum of them all (``batch.checksum``).

    In one pass where the copy-and-checksum kernel is at hand (kernels/cpu_copysum.py:
    each stripe loaded once, stored and hashed from the same register). Otherwise in
    cache-sized pieces, each hashed right after it is copied, while it is still in
    cache; one hasher for all of them, and no call per piece beyond the copy and the
    update.
    """
    mod = copysum.kernel()
    if mod is not None and sum(map(_NBYTES, sources)) > copysum.SHORT:
        return copysum.copy_sum(mod, destination, sources)
    hasher, at = xxhash.xxh3_64(), 0  # seed 0, as wire.checksum
    update = hasher.update
    for source in sources:
        nbytes = source.nbytes
        if nbytes <= _PIECE:
            destination[at : at + nbytes] = source
            update(source)
        else:
            for start in range(0, nbytes, _PIECE):
                piece = source[start : start + _PIECE]
                destination[at + start : at + start + piece.nbytes] = piece
                update(piece)
        at += nbytes
    return hasher.intdigest()


class _Connection(asyncio.Protocol):
    """The control connection to one receiver, and its ring.

    ``write`` corks frames (see the module's docstring); ``flush`` writes them now.
    Verdicts go to the ring as they are read. ``on_lost(reason)`` is called once, when
    the connection ends.
    """

    def __init__(self, ring: Ring, on_lost) -> None:
        self.ring, self.on_lost = ring, on_lost
        self.transport: asyncio.Transport | None = None
        self.parser = control.FrameParser(KNOWN_VERDICTS)
        self.corked: list[bytes] = []
        self.corked_bytes = 0  # payload bytes the corked frames announce
        self.flushing: asyncio.Handle | None = None
        self.resumed: asyncio.Future | None = None  # while the transport is paused
        self.reason: str | None = None
        self.closed = asyncio.get_running_loop().create_future()

    def usable(self) -> bool:
        return self.ring.error is None and not self.closed.done()

    def write(self, frame: bytes, announced: int = 0) -> None:
        self.corked.append(frame)
        self.corked_bytes += announced
        if self.corked_bytes >= _FLUSH_BYTES:
            self.flush()
        elif self.flushing is None:
            self.flushing = asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        if self.flushing is not None:
            self.flushing.cancel()
            self.flushing = None
        if self.corked and not self.transport.is_closing():
            self.transport.write(b"".join(self.corked))
        self.corked.clear()
        self.corked_bytes = 0

    async def drain(self) -> None:
        """Return once the transport takes more (frames are small, but a receiver that
        stops reading must not make them pile up here)."""
        if self.resumed is not None:
            await asyncio.shield(self.resumed)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        try:
            for frame in self.parser.feed(data):
                self.ring.release(*(frame if isinstance(frame, tuple) else read_verdict(frame)))
        except control.ControlError as exc:
            log.warning("kv_transfer.protocol_error", backend="shm", error=str(exc))
            self.reason = self.reason or f"receiver protocol error: {exc}"
            self.transport.abort()

    def eof_received(self) -> bool:
        return False  # close our side too; connection_lost follows

    def pause_writing(self) -> None:
        self.resumed = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        resumed, self.resumed = self.resumed, None
        if resumed is not None and not resumed.done():
            resumed.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.flushing is not None:
            self.flushing.cancel()
        self.resume_writing()
        self.closed.set_result(None)
        lost = "receiver connection lost" + (f" ({type(exc).__name__})" if exc else "")
        self.on_lost(self.reason or lost)


class ShmSender(ConnectionSender):
    """KVSender over shared memory, for receivers on this host; ``send_many`` sends
    batches (``batch.py``), each staged in one place.

    Per receiver: up to ``slots`` segments and ``max_in_flight_bytes`` in flight (a
    larger chunk goes alone), each segment at least ``min_segment_bytes`` and grown to
    the largest chunk sent through it. ``segments_created`` counts segments made so far.
    """

    BATCHES = True

    def __init__(
        self,
        *,
        slots: int = 16,
        max_in_flight_bytes: int = 64 << 20,
        min_segment_bytes: int = 4 << 20,
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
        return self._created_before + sum(c.ring.created for c in self._conns.values())

    @property
    def connections(self) -> int:
        return sum(conn.usable() for conn in self._conns.values())

    async def _post(self, attempt: InFlight) -> None:
        chunk, view, address, nbytes = attempt.chunk, attempt.view, attempt.address, attempt.nbytes
        request_id = chunk.request_id
        conn = await self._connection(address)
        try:
            slot, segment, offset = await conn.ring.place(attempt, conn.flush)
        except OSError as exc:
            raise TransferError(
                f"cannot stage {nbytes} bytes in shared memory: {exc}", request_id
            ) from exc
        if type(view) is list:  # a batch: its chunks back to back, one checksum
            staged = stage_many(segment.view[offset:], view)
        else:
            staged = stage(segment.view[offset:], view)
        if attempt.claimed is None:
            attempt.claimed = staged
        frame = chunk_frame(chunk, slot, conn.ring.generations[slot], offset, nbytes,
                            attempt.claimed)
        await self._write(address, conn, request_id, frame, nbytes)
        if type(view) is list:
            conn.flush()  # a batch: see the module's docstring
        if nbytes >= _WARM_BYTES:
            # The verdicts that came are read on the loop's next turn, after this task
            # has run on: two turns.
            await asyncio.sleep(0)
            await asyncio.sleep(0)

    async def _write_end(self, address, message) -> None:
        kind = "finish" if isinstance(message, wire.Finish) else "abort"
        frame = control.pack(kind, **message._asdict())
        conn = await self._connection(address)
        await self._write(address, conn, message.request_id, frame)
        conn.flush()  # the sender's finish waits for the verdicts it brings back

    async def close(self) -> None:
        """Close every connection once the receiver has taken what was sent on it (at
        most ``connect_timeout_s`` each), then remove every segment."""
        self._closed = True
        await self._stop_resending()
        conns, self._conns = self._conns, {}
        for conn in conns.values():
            self._created_before += conn.ring.created
            conn.flush()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._connect_timeout_s):
                    await conn.ring.drained()
            conn.ring.destroy("sender closed")
            conn.transport.close()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._connect_timeout_s):
                    await asyncio.shield(conn.closed)
            conn.transport.abort()

    async def _write(
        self, address: str, conn: _Connection, rid: str, frame: bytes, announced: int = 0
    ) -> None:
        if not conn.usable():
            self._drop(address, conn)
            raise TransferError(f"connection to {address} broke: {conn.ring.error}", rid)
        conn.write(frame, announced)
        await conn.drain()

    async def _dial(self, address: str) -> _Connection:
        host, port = dial_target(address, SCHEME)
        if port == 0:
            raise ValueError(f"cannot connect to port 0: {address!r}")
        ring = Ring(self._directory, self._slots, self._min_bytes, self._budget)
        conn = _Connection(ring, lambda reason: self._drop(address, conn, reason))
        loop = asyncio.get_running_loop()
        local = shm_control.socket_path(self._directory, host, port)
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                try:  # the receiver's Unix-domain control socket, where it has one
                    if local is None:
                        raise FileNotFoundError
                    await loop.create_unix_connection(lambda: conn, local)
                except OSError:  # none there, or not one to use: its TCP address
                    await loop.create_connection(lambda: conn, host, port)
        except OSError as exc:  # TimeoutError is an OSError
            ring.destroy("not connected")
            raise TransferError(f"cannot connect to {address}: {exc!r}") from exc
        # The prefix goes out before any segment exists, so the receiver can always
        # remove what this connection leaves behind.
        conn.write(control.pack("hello", v=VERSION, prefix=ring.prefix))
        conn.flush()
        return conn

    def _drop(self, address: str, conn: _Connection, reason: str = "connection dropped") -> None:
        if self._conns.get(address) is conn:
            del self._conns[address]
            self._created_before += conn.ring.created
        if conn.transport is not None:
            conn.transport.abort()
        conn.ring.destroy(reason)
