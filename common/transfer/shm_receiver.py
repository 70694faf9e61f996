"""Receiving side of the shm backend (protocol and segment lifetime: ``shm.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket

import structlog

from common.address import dial_target, format_address
from common.transfer import control, shm_control, wire
from common.transfer.batch import Batch
from common.transfer.landing import scatterer
from common.transfer.shm import OK_FRAMES, SCHEME, VERSION, read_chunk, verdict_frame
from common.transfer.shm_segment import (
    SHM_DIR,
    Segment,
    is_valid_name,
    segment_name,
    unlink_prefix,
)
from common.transfer.table_receiver import TableReceiver

log = structlog.get_logger("pdserve.transfer")


class _Peer(asyncio.Protocol):
    """One sender connection on the receiving side: parses its frames in batches, maps
    its slots, and remembers the request ids it carried messages for (to fail them if it
    dies). Verdicts for a batch of chunks go back in one write."""

    def __init__(self, receiver: ShmReceiver) -> None:
        self.rx = receiver
        self.transport: asyncio.Transport | None = None
        self.parser = control.FrameParser()
        self.prefix: str | None = None
        self.maps: dict[int, tuple[int, Segment]] = {}  # slot -> (generation, segment)
        self.carried: set[str] = set()
        self.verdicts: list[bytes] = []
        self.reason = "sender connection lost"
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.rx._track(self)

    def data_received(self, data: bytes) -> None:
        try:
            for fields in self.parser.feed(data):
                if self.prefix is None:
                    self.hello(fields)
                elif isinstance(fields, bytes):  # a binary record: only chunks are
                    self.chunk(fields)
                else:
                    self.handle(fields)
        except control.ControlError as exc:
            log.warning("kv_transfer.protocol_error", backend="shm", error=str(exc))
            if exc.request_id is not None:
                self.rx.table.fail_untokened(exc.request_id, f"malformed message: {exc}")
            self.reason = f"sender protocol error: {exc}"
            self.transport.abort()
        finally:
            self.answer()

    def answer(self) -> None:
        """Write the verdicts given so far."""
        if self.verdicts and not self.transport.is_closing():
            self.transport.write(b"".join(self.verdicts))
        self.verdicts.clear()

    def eof_received(self) -> bool:
        return False  # close our side too; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.end(self.reason)
        self.rx._untrack(self)
        self.closed.set_result(None)

    def hello(self, fields: dict | bytes) -> None:
        if isinstance(fields, bytes):
            raise control.ControlError("first frame must be hello, got a binary record")
        if fields.get("t") != "hello" or set(fields) != {"t", "v", "prefix"}:
            raise control.ControlError(f"first frame must be hello, got {fields.get('t')!r}")
        if fields["v"] != VERSION:
            raise control.ControlError(f"unsupported version {fields['v']!r} (speaks {VERSION})")
        if not is_valid_name(fields["prefix"]) or fields["prefix"].count("-") != 2:
            raise control.ControlError(f"bad segment prefix {fields['prefix']!r}")
        self.prefix = fields["prefix"]

    def handle(self, fields: dict) -> None:
        table, kind = self.rx.table, fields["t"]
        self.answer()  # the sender's finish waits for them; ending the transfer takes longer
        if kind == "finish":
            msg = control.finish(fields)
            table.on_finish(msg.request_id, msg.num_chunks, msg.token)
        elif kind == "abort":
            msg = control.message(fields, wire.Abort)
            table.on_abort(msg.request_id, msg.reason, msg.token)
        else:
            raise control.ControlError(f"unknown frame type {kind!r}")
        self.carried.discard(msg.request_id)

    def chunk(self, body: bytes) -> None:
        msg, slot, generation, offset, length = read_chunk(body)
        rid, table = msg.request_id, self.rx.table
        if len(self.carried) > 4096:
            self.carried = {r for r in self.carried if table.is_live(r)}
        verdict = wire.DROPPED
        try:
            if not table.admits(rid, msg.token):  # not live, or refused (and counted)
                if not table.is_live(rid):
                    table.drop(rid, "chunk")
                return
            self.carried.add(rid)  # admitted: losing this sender ends the transfer
            if length > self.rx.max_payload:
                limit = self.rx.max_payload
                verdict = table.fail(rid, f"chunk of {length} bytes exceeds the {limit}-byte limit")
            else:
                view = self._view(slot, generation, offset, length)
                # Copying out of the segment is the one pass over the bytes: hash them
                # as they land where the sink wants them (where it names a place).
                scatter = self.rx.scatter()
                if type(msg) is Batch:
                    verdict = table.on_batch(msg, view, None, scatter)
                else:
                    verdict = table.on_chunk(rid, msg.layer, msg.block_ids, view,
                                             msg.checksum, msg.attempt, msg.token,
                                             msg.heads, None, scatter)
        except (OSError, ValueError) as exc:
            name = segment_name(self.prefix, slot, generation)
            verdict = table.fail(rid, f"shared-memory segment {name!r} unusable: {exc}")
        finally:
            ok = verdict is wire.OK
            self.verdicts.append(OK_FRAMES[slot] if ok else verdict_frame(slot, verdict))

    def _view(self, slot: int, generation: int, offset: int, length: int) -> memoryview:
        mapped = self.maps.get(slot)
        if mapped is None or mapped[0] != generation:
            if mapped is not None:
                mapped[1].close()
                del self.maps[slot]
            segment = Segment.attach(self.rx.directory,
                                     segment_name(self.prefix, slot, generation))
            segment.unlink()  # mapped on both sides now: the name has served its purpose
            mapped = self.maps[slot] = (generation, segment)
        segment = mapped[1]
        if offset + length > segment.size:
            raise ValueError(f"bytes [{offset}, {offset + length}) beyond its {segment.size}")
        return segment.view[offset : offset + length]

    def end(self, reason: str) -> None:
        for rid in self.carried:
            self.rx.table.fail(rid, reason)
        self.carried.clear()
        for _, segment in self.maps.values():
            segment.close()
        self.maps.clear()
        if self.prefix is not None:
            unlink_prefix(self.rx.directory, self.prefix)


class ShmReceiver(TableReceiver):
    """KVReceiver over shared memory. Give ``sink`` or a ``table`` shared with other
    receivers (``multi.py``), not both. ``dropped`` counts messages for ids not live."""

    SCHEME = SCHEME

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, directory: str = SHM_DIR,
                 **common) -> None:
        """``common``: ``TableReceiver``'s sink, table and max_payload_bytes."""
        super().__init__(host, port, **common)
        self.directory = directory
        self._server: asyncio.Server | None = None
        self._local: asyncio.Server | None = None  # the Unix-domain control socket
        self._local_path = ""
        self._scatter = None  # the fused copy-and-checksum pass, once there is one

    def scatter(self):
        """``landing.scatterer`` for this receiver's table, looked up until the kernel is
        built, then kept (asked once a BATCH)."""
        if self._scatter is None:
            self._scatter = scatterer(self.table.lands)
        return self._scatter

    async def _listen(self) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Peer(self), self._host, self._port)
        port = self._server.sockets[0].getsockname()[1]
        await self._listen_locally(dial_target(format_address(SCHEME, self._host, port),
                                               SCHEME), port)
        return port

    async def _listen_locally(self, target: tuple[str, int], port: int) -> None:
        """Serve the same peers on the control socket for this address as well, where
        there can be one (``shm_control.py``); the TCP address serves regardless."""
        path = shm_control.socket_path(self.directory, target[0], port, create=True)
        if path is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a dead receiver's: this one holds the port now
        try:
            self._local = await asyncio.get_running_loop().create_unix_server(
                lambda: _Peer(self), path=path)
            self._local_path = path
        except OSError as exc:
            log.debug("kv_transfer.no_control_socket", path=path, error=str(exc))

    async def _stop(self) -> None:
        if self._local is not None:
            self._local.close()
            with contextlib.suppress(OSError):
                os.unlink(self._local_path)
        if self._server is not None:
            self._server.close()
        peers = list(self._connections)
        for peer in peers:
            peer.transport.abort()  # connection_lost unmaps and unlinks its segments
        await asyncio.gather(*(peer.closed for peer in peers))
        for server in (self._server, self._local):
            if server is not None:
                await server.wait_closed()
