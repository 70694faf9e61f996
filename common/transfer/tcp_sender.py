"""Sending side of the tcp backend (protocol and socket settings: ``tcp.py``).

asyncio streams: one connection per receiver address, kept while it works, with a lock
so that messages never interleave; a task per connection reads the receiver's verdicts.

Per-message costs are what limit small payloads (a system call, a wake-up of the
receiver, a pass through the event loop each), so a message whose payload is at most
``JOIN_BYTES`` is corked: its head and payload (not copied) wait, with the messages
corked after it, until the event loop's next turn, a FINISH or ABORT, a large message,
or ``CORK_BYTES`` of them, and then go out in one ``sendmsg`` (scatter-gather). A run of
small sends then costs one system call here and one wake-up on the receiver, instead of
one each. What the kernel does not take at once is handed to the transport, and the
next message waits until it is drained. A larger message goes out with ``sendmsg``
straight from its head and payload views for as long as the kernel takes them (a system
call per socket buffer's worth); once it takes no more, one ``write_slice_bytes`` slice
(256 KiB) is handed to the transport and drained before the next try, so at most one
slice is ever copied into the transport's buffer (which, on Python 3.11, also shifts it
down after every partial send). Writing every 256 KiB slice through the transport,
drained one by one, cost 64 writes and loop passes a 16 MiB request: 0.62-0.69x of a
raw socket's throughput, against 0.70-0.76x this way (bench/transfer.py).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket

import structlog

from common.address import dial_target
from common.transfer import wire
from common.transfer.base import TransferError
from common.transfer.connections import InFlight, StreamSender
from common.transfer.tcp import CORK_BYTES, JOIN_BYTES, SCHEME, SOCKET_BUFFER_BYTES, tune_socket

log = structlog.get_logger("pdserve.transfer")


_MAX_CORKED = 256  # buffers in one sendmsg, well under IOV_MAX (1024)


class _Connection:
    __slots__ = ("reader", "writer", "sock", "lock", "broken", "verdicts", "task",
                 "corked", "corked_bytes", "flushing", "error")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 sock: socket.socket) -> None:
        self.reader, self.writer, self.sock = reader, writer, sock
        self.lock = asyncio.Lock()
        self.broken = False
        # The chunks written and not answered yet, in write order.
        self.verdicts: collections.deque[InFlight] = collections.deque()
        self.task: asyncio.Task | None = None
        self.corked: list[bytes | memoryview] = []  # heads and payloads, in order
        self.corked_bytes = 0
        self.flushing: asyncio.Handle | None = None
        self.error: OSError | None = None  # a flush that failed: the connection is gone

    def cork(self, head: bytes, payload: memoryview | list[memoryview] | None,
             size: int = 0) -> None:
        """Queue ``head`` and ``payload`` (``size`` bytes: a batch's total, known to the
        caller) for the next flush."""
        self.corked.append(head)
        self.corked_bytes += len(head)
        if type(payload) is list:  # a batch's payloads, back to back
            self.corked += payload
            self.corked_bytes += size
        elif payload is not None and payload.nbytes:
            self.corked.append(payload)
            self.corked_bytes += payload.nbytes
        if self.corked_bytes >= CORK_BYTES or len(self.corked) >= _MAX_CORKED:
            self.flush()
        elif self.flushing is None:
            self.flushing = asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        """Hand every corked buffer to the kernel in one ``sendmsg``; what it does not
        take goes to the transport (which copies it), in order."""
        if self.flushing is not None:
            self.flushing.cancel()
            self.flushing = None
        corked, total = self.corked, self.corked_bytes
        self.corked, self.corked_bytes = [], 0
        if not corked or self.broken or self.writer.is_closing():
            return
        sent = 0
        if not self.writer.transport.get_write_buffer_size():  # else it must go first
            try:
                sent = self.sock.sendmsg(corked)
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as exc:
                self.error = exc
                self.writer.transport.abort()  # the verdict reader then fails the chunks
                return
            if sent == total:  # the usual case: all of it taken, nothing left to queue
                return
        for buffer in corked:
            size = len(buffer) if isinstance(buffer, bytes) else buffer.nbytes
            if sent >= size:
                sent -= size
                continue
            self.writer.transport.write(buffer[sent:] if sent else buffer)
            sent = 0

    def usable(self) -> bool:
        return not (self.broken or self.writer.is_closing() or self.reader.at_eof())

    def fail_waiting(self, reason: str) -> None:
        while self.verdicts:
            self.verdicts.popleft().lost(reason)


class TcpSender(StreamSender):
    """KVSender over TCP; ``send_many`` sends batches (``batch.py``).

    Payloads are written in ``write_slice_bytes`` slices, each drained into the kernel
    before the next, so a large chunk is never copied whole into the transport's buffer.
    The connection's lock is held only while a message is written; a task per
    connection reads the verdicts, which come back in the order the chunks went out.
    """

    BATCHES = True
    # A batch is hashed (its checksum is in its header) and then written: at most what
    # is corked into one sendmsg, it is still in cache when the kernel copies it (a 16
    # MiB request in batches of 1.7 MB rather than 4 MiB: 0.79-0.82x the raw socket's
    # throughput against 0.70-0.76x, bench/transfer.py).
    BATCH_BYTES = CORK_BYTES

    def __init__(
        self,
        *,
        connect_timeout_s: float = 5.0,
        write_slice_bytes: int = 256 << 10,
        socket_buffer_bytes: int = SOCKET_BUFFER_BYTES,
    ) -> None:
        if connect_timeout_s <= 0 or write_slice_bytes <= 0:
            raise ValueError("connect_timeout_s and write_slice_bytes must be > 0")
        super().__init__()
        self._connect_timeout_s = connect_timeout_s
        self._slice = write_slice_bytes
        self._buffer_bytes = socket_buffer_bytes

    async def close(self) -> None:
        self._closed = True
        await self._stop_resending()
        conns, self._conns = self._conns, {}
        for conn in conns.values():
            conn.flush()
            conn.broken = True
            conn.writer.close()  # flushes what is buffered, then FIN
        for conn in conns.values():
            with contextlib.suppress(OSError):
                await conn.writer.wait_closed()
            if conn.task is not None:
                conn.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await conn.task
            conn.fail_waiting("sender closed")

    async def _write(
        self,
        address: str,
        request_id: str,
        head: bytes,
        payload: memoryview | list[memoryview] | None,
        attempt: InFlight | None = None,
    ) -> None:
        """Write one message; a chunk's ``attempt`` then waits for its verdict. A
        batch's ``payload`` is its chunks' views, written back to back."""
        views = payload if type(payload) is list else None
        size = 0 if payload is None else attempt.nbytes if views is not None else payload.nbytes
        for _ in range(3):  # another call may break the connection while we queue for it
            conn = await self._connection(address)
            async with conn.lock:
                if not conn.usable():
                    self._drop(address, conn)
                    continue
                if conn.writer.transport.get_write_buffer_size():
                    await self._drained(address, conn, request_id)  # backpressure
                    if not conn.usable():
                        self._drop(address, conn)
                        continue
                if attempt is not None:
                    conn.verdicts.append(attempt)
                if size <= (CORK_BYTES if views is not None else JOIN_BYTES):
                    # Whole or not at all: a cancel after this leaves the stream framed.
                    conn.cork(head, payload, size)
                    if payload is None:
                        conn.flush()  # FINISH, ABORT: the receiver answers what came
                    return
                conn.flush()
                try:
                    await self._write_through(conn, [memoryview(head), *(views or (payload,))])
                except BaseException as exc:
                    # Part of a message may be out: the stream is no longer framed.
                    self._drop(address, conn, f"connection to {address} broke: {exc!r}")
                    if isinstance(exc, OSError):
                        raise TransferError(
                            f"connection to {address} broke: {exc!r}", request_id
                        ) from exc
                    raise
            return
        raise TransferError(f"connection to {address} kept breaking", request_id)

    async def _write_through(self, conn: _Connection, buffers: list[memoryview]) -> None:
        """Write ``buffers`` (a message: its head and payload views) with ``sendmsg``
        straight from them while the kernel takes them; once it takes no more, hand the
        transport one ``write_slice_bytes`` slice (which it copies) and wait until that
        is drained, then go on. A large message thus costs a system call per socket
        buffer's worth, not per slice, and at most a slice is ever copied."""
        sock, writer, at = conn.sock, conn.writer, 0
        while True:
            sent = 0
            if not writer.transport.get_write_buffer_size():
                with contextlib.suppress(BlockingIOError, InterruptedError):
                    sent = sock.sendmsg(buffers[at : at + _MAX_CORKED])
            while sent:
                size = buffers[at].nbytes
                if sent < size:
                    buffers[at] = buffers[at][sent:]
                    break
                sent -= size
                at += 1
            if at == len(buffers):
                return
            first = buffers[at]
            writer.write(first[: self._slice])
            if first.nbytes > self._slice:
                buffers[at] = first[self._slice :]
            else:
                at += 1
            await writer.drain()
            if at == len(buffers):
                return

    async def _drained(self, address: str, conn: _Connection, request_id: str) -> None:
        try:
            await conn.writer.drain()
        except OSError as exc:
            self._drop(address, conn, f"connection to {address} broke: {exc!r}")
            raise TransferError(f"connection to {address} broke: {exc!r}", request_id) from exc

    async def _read_verdicts(self, address: str, conn: _Connection) -> None:
        reader, unparsed = conn.reader, bytearray()
        try:
            while True:
                data = await reader.read(1 << 16)
                if not data:
                    raise asyncio.IncompleteReadError(bytes(unparsed), None)
                unparsed += data
                verdicts, parsed = wire.split_verdicts(unparsed)
                del unparsed[:parsed]
                for verdict in verdicts:
                    if not conn.verdicts:
                        raise wire.WireError("a verdict for no chunk")
                    conn.verdicts.popleft().answered(verdict)
        except (asyncio.IncompleteReadError, OSError) as exc:
            exc = conn.error or exc
            reason = f"connection to {address} lost before the receiver's verdict: {exc!r}"
        except wire.WireError as exc:
            log.warning("kv_transfer.protocol_error", backend="tcp", error=str(exc))
            reason = f"receiver protocol error: {exc}"
        except Exception as exc:  # a bug's last line of defence: fail the chunks, never
            log.exception("kv_transfer.verdict_reader_failed", backend="tcp")  # hang them
            reason = f"verdict reader failed: {exc!r}"
        self._drop(address, conn, reason)

    async def _dial(self, address: str) -> _Connection:
        host, port = dial_target(address, SCHEME)
        if port == 0:
            raise ValueError(f"cannot connect to port 0: {address!r}")
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
                error: OSError = OSError(f"no address for {host!r}")
                for family, type_, proto, _, sockaddr in infos:
                    sock = socket.socket(family, type_, proto)
                    try:
                        tune_socket(sock, self._buffer_bytes)
                        sock.setblocking(False)
                        await loop.sock_connect(sock, sockaddr)
                    except OSError as exc:
                        sock.close()
                        error = exc
                        continue
                    except BaseException:
                        sock.close()
                        raise
                    reader, writer = await asyncio.open_connection(sock=sock)
                    # Any buffered byte pauses writing, so drain() returns only once the
                    # kernel holds every byte: the transport keeps no reference to the
                    # caller's payload once it is written (it may on Python >= 3.12);
                    # only its InFlight does, until the verdict.
                    writer.transport.set_write_buffer_limits(high=0)
                    conn = _Connection(reader, writer, sock)
                    conn.task = asyncio.create_task(self._read_verdicts(address, conn))
                    return conn
                raise error
        except OSError as exc:  # TimeoutError is an OSError
            raise TransferError(f"cannot connect to {address}: {exc!r}") from exc

    def _drop(self, address: str, conn: _Connection, reason: str = "connection dropped") -> None:
        conn.broken = True
        conn.corked.clear()
        if self._conns.get(address) is conn:
            del self._conns[address]
        conn.writer.transport.abort()
        conn.fail_waiting(reason)
