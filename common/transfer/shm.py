"""The shm backend: same-host peers move KV through shared memory; only small control
frames cross a socket. The sender is in ``shm_sender.py``.

Address: ``shm://host:port``, the TCP control channel the receiver listens on (loopback
by default; IPv6 hosts in brackets). Payload bytes never cross it.

Control frames (``control.py``: u32 length | msgpack map with type ``t``)::

    sender -> receiver
      hello    {v: 2, prefix}          first frame; this connection's segments are
                                       <prefix>-<slot>-<generation> in the shm directory
      chunk    {request_id, layer, block_ids, checksum,     fields of wire.Chunk
                attempt, slot, segment, offset, length}     where the payload lies
      finish   {request_id, num_chunks}
      abort    {request_id, reason}
    receiver -> sender
      verdict  {slot, status, reason}  the receiver is done with the bytes of the
                                       oldest chunk in that slot it had not answered;
                                       what became of that chunk (wire.Verdict: ok,
                                       dropped, resend, failed)

The receiver answers chunks in the order they came, in one write for all the frames
that one read brought.

The ring: each sender connection owns up to ``slots`` reusable segments. Chunks are
placed in a slot's segment one after another (at page boundaries) while they fit, so
small chunks share one; a slot is reused once every chunk in it is answered. A send
waits for room while no slot can take its chunk or the bytes in flight would pass the
sender's ``max_in_flight_bytes`` (backpressure: a receiver that falls behind holds its
senders back, and nothing buffers without bound); its verdict comes later. On "resend"
the sender stages the caller's payload again (wherever there is room) as attempt 1.
One copy: the sender copies the payload into its slot; the receiver verifies it and
hands the sink a read-only view of the mapped segment, copying nothing itself.

Segment lifetime (nothing left in /dev/shm):
- the sender creates a slot's segment at the slot's first use, and a larger one (new
  generation, old name removed) when a chunk does not fit it while it is empty;
- the receiver maps a segment at its first chunk and removes its name at once: the
  memory then lives only as long as the two mappings, even if both processes die;
- when a connection ends, for any reason, both sides remove every ``<prefix>-*`` name
  left, which covers a segment created but not yet mapped. The only window left is both
  processes killed between a segment's creation and its first mapping.

Dead peer: when a sender's connection ends, each live transfer that carried a message
on it fails at once ("sender connection lost"); the sender's ``send`` raises
TransferError when the receiver's connection ends.
"""

from __future__ import annotations

import asyncio
import socket

import structlog

from common.transfer import control, wire
from common.transfer.base import ChunkSink
from common.transfer.shm_segment import SHM_DIR, Segment, is_valid_name, unlink_prefix
from common.transfer.table import TableReceiver, TransferTable
from common.transfer.tcp import format_address, parse_address

log = structlog.get_logger("pdserve.transfer")

SCHEME = "shm://"
VERSION = 2
MAX_SLOTS = 64
_CHUNK_EXTRA = ("slot", "segment", "offset", "length")


def parse_shm_address(address: str) -> tuple[str, int]:
    """``"shm://host:port"`` -> ``(host, port)``; ValueError if malformed."""
    if not isinstance(address, str) or not address.startswith(SCHEME):
        raise ValueError(f"not a shm address (shm://host:port): {address!r}")
    try:
        return parse_address("tcp://" + address[len(SCHEME) :])
    except ValueError:
        raise ValueError(f"not a shm address (shm://host:port): {address!r}") from None


def verdict_frame(slot: int, verdict: wire.Verdict) -> bytes:
    return control.pack("verdict", slot=slot, status=verdict.status.value, reason=verdict.reason)


def read_verdict(fields: dict) -> tuple[int, wire.Verdict]:
    """``(slot, verdict)`` of a verdict frame; ControlError if it is not one."""
    if fields.get("t") != "verdict" or set(fields) != {"t", "slot", "status", "reason"}:
        raise control.ControlError(f"unexpected frame {fields.get('t')!r}")
    slot = control.uint(fields, "slot", MAX_SLOTS - 1)
    if fields["status"] == "ok" and fields["reason"] == "":
        return slot, wire.OK  # almost every verdict
    try:
        verdict = wire.Verdict(wire.Status(fields["status"]), fields["reason"])
        wire.validate(verdict)
    except (ValueError, wire.WireError) as exc:
        raise control.ControlError(f"bad verdict: {exc}") from None
    return slot, verdict


# The verdict almost every chunk gets, one frame per slot: written and read without msgpack.
OK_FRAMES = tuple(verdict_frame(slot, wire.OK) for slot in range(MAX_SLOTS))
KNOWN_VERDICTS = {frame: (slot, wire.OK) for slot, frame in enumerate(OK_FRAMES)}


class _Peer(asyncio.Protocol):
    """One sender connection on the receiving side: parses its frames in batches, maps
    its slots, and remembers the request ids it carried messages for (to fail them if it
    dies). Verdicts for a batch of chunks go back in one write."""

    def __init__(self, receiver: ShmReceiver) -> None:
        self.rx = receiver
        self.transport: asyncio.Transport | None = None
        self.parser = control.FrameParser()
        self.prefix: str | None = None
        self.maps: dict[int, Segment] = {}
        self.carried: set[str] = set()
        self.verdicts: list[bytes] = []
        self.reason = "sender connection lost"
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.rx._peers.add(self)

    def data_received(self, data: bytes) -> None:
        try:
            for fields in self.parser.feed(data):
                if self.prefix is None:
                    self.hello(fields)
                else:
                    self.handle(fields)
        except control.ControlError as exc:
            log.warning("kv_transfer.protocol_error", backend="shm", error=str(exc))
            if exc.request_id is not None:
                self.rx.table.fail(exc.request_id, f"malformed message: {exc}")
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
        self.rx._peers.discard(self)
        self.closed.set_result(None)

    def hello(self, fields: dict) -> None:
        if fields.get("t") != "hello" or set(fields) != {"t", "v", "prefix"}:
            raise control.ControlError(f"first frame must be hello, got {fields.get('t')!r}")
        if fields["v"] != VERSION:
            raise control.ControlError(f"unsupported version {fields['v']!r} (speaks {VERSION})")
        if not is_valid_name(fields["prefix"]) or fields["prefix"].count("-") != 2:
            raise control.ControlError(f"bad segment prefix {fields['prefix']!r}")
        self.prefix = fields["prefix"]

    def handle(self, fields: dict) -> None:
        table, kind = self.rx.table, fields["t"]
        if kind == "chunk":
            self.chunk(fields)
            return
        self.answer()  # the sender's finish waits for them; ending the transfer takes longer
        if kind == "finish":
            msg = control.message(fields, wire.Finish)
            table.on_finish(msg.request_id, msg.num_chunks)
        elif kind == "abort":
            msg = control.message(fields, wire.Abort)
            table.on_abort(msg.request_id, msg.reason)
        else:
            raise control.ControlError(f"unknown frame type {kind!r}")
        self.carried.discard(msg.request_id)

    def chunk(self, fields: dict) -> None:
        msg = control.message(fields, wire.Chunk, _CHUNK_EXTRA)
        slot = control.uint(fields, "slot", MAX_SLOTS - 1)
        offset, length = control.uint(fields, "offset"), control.uint(fields, "length")
        segment, rid, table = fields["segment"], msg.request_id, self.rx.table
        if len(self.carried) > 4096:
            self.carried = {r for r in self.carried if table.is_live(r)}
        self.carried.add(rid)
        verdict = wire.DROPPED
        try:
            if not table.is_live(rid):
                table.drop(rid, "chunk")
            elif length > self.rx.max_payload:
                limit = self.rx.max_payload
                verdict = table.fail(rid, f"chunk of {length} bytes exceeds the {limit}-byte limit")
            else:
                view = self._view(slot, segment, offset, length)
                verdict = table.on_chunk(
                    rid, msg.layer, msg.block_ids, view, msg.checksum, msg.attempt
                )
        except (OSError, ValueError) as exc:
            verdict = table.fail(rid, f"shared-memory segment {segment!r} unusable: {exc}")
        finally:
            ok = verdict is wire.OK
            self.verdicts.append(OK_FRAMES[slot] if ok else verdict_frame(slot, verdict))

    def _view(self, slot: int, name: object, offset: int, length: int) -> memoryview:
        segment = self.maps.get(slot)
        if segment is None or segment.name != name:
            if not (is_valid_name(name) and name.startswith(f"{self.prefix}-{slot}-")):
                raise ValueError(f"segment name not of this connection's slot {slot}")
            if segment is not None:
                segment.close()
                del self.maps[slot]
            segment = Segment.attach(self.rx.directory, name)
            segment.unlink()  # mapped on both sides now: the name has served its purpose
            self.maps[slot] = segment
        if offset + length > segment.size:
            raise ValueError(f"bytes [{offset}, {offset + length}) beyond its {segment.size}")
        return segment.view[offset : offset + length]

    def end(self, reason: str) -> None:
        for rid in self.carried:
            self.rx.table.fail(rid, reason)
        self.carried.clear()
        for segment in self.maps.values():
            segment.close()
        self.maps.clear()
        if self.prefix is not None:
            unlink_prefix(self.rx.directory, self.prefix)


class ShmReceiver(TableReceiver):
    """KVReceiver over shared memory. Give ``sink`` or a ``table`` shared with other
    receivers (``multi.py``), not both. ``dropped`` counts messages for ids not live."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        sink: ChunkSink | None = None,
        table: TransferTable | None = None,
        directory: str = SHM_DIR,
        max_payload_bytes: int = 1 << 30,
    ) -> None:
        if (sink is None) == (table is None):
            raise TypeError("give exactly one of sink and table")
        if not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {port!r}")
        if max_payload_bytes <= 0:
            raise ValueError(f"max_payload_bytes must be > 0, got {max_payload_bytes}")
        self._host, self._port = host, port
        self.table = table if table is not None else TransferTable(sink)
        self.directory = directory
        self.max_payload = max_payload_bytes
        self._server: asyncio.Server | None = None
        self._peers: set[_Peer] = set()
        self._address: str | None = None
        self._closed = False

    @property
    def connections(self) -> int:
        return len(self._peers)

    def _serving(self) -> bool:
        return self._server is not None and not self._closed

    async def start(self) -> None:
        if self._server is not None or self._closed:
            raise RuntimeError("receiver already started" if self._server else "receiver closed")
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Peer(self), self._host, self._port)
        port = self._server.sockets[0].getsockname()[1]
        self._address = format_address(self._host, port).replace("tcp://", SCHEME, 1)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.table.cancel_all("receiver closed")
        if self._server is not None:
            self._server.close()
        peers = list(self._peers)
        for peer in peers:
            peer.transport.abort()  # connection_lost unmaps and unlinks its segments
        await asyncio.gather(*(peer.closed for peer in peers))
        if self._server is not None:
            await self._server.wait_closed()
