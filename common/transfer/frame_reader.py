"""Receiving side of one stream connection: bytes in, ``TransferTable`` calls out.

A ``BufferedProtocol`` rather than a ``StreamReader``: the event loop ``recv_into``s
straight into this reader's buffers, so a payload reaches the sink without passing
through an intermediate stream buffer or a ``bytes`` copy. Per connection it holds::

    ahead    4 MiB + 64 KiB         what the socket had, read in one go: prefixes,
                                    headers, payloads (the rest of one that fits its
                                    room read in after it); grown for a larger header
    payload  largest chunk so far   a payload that does not fit there, received
                                    straight into place; reused, grown, never shrunk
    scratch  1 MiB                  sink for payloads nobody wants (unknown request id)

Reading ahead matters for small chunks: one ``recv`` then brings in the whole message,
or several, where reading each prefix, header and payload into its own buffer took
three trips through the event loop per message. Large chunks are better off without it:
after a payload of more than ``_EXACT_BYTES`` (256 KiB), the reader asks for the next
prefix and header and at most ``_SLACK_BYTES`` (4 KiB) after them, so that the next
payload lands straight in its place but for its first few KiB, copied; a smaller payload
turns reading ahead back on. (Asking for the prefix alone, then the header, cost two
extra trips through the event loop per large chunk.)

While a large payload comes in, a TCP socket's ``SO_RCVLOWAT`` says when the event loop
wakes this reader (``tcp.ReadMark``: once a MiB, but for a transfer's first payload).

A payload read straight into place is hashed as it comes in, each piece while in cache,
and the table is handed that checksum (not a second pass after its last byte). Where
the sink names a BATCH's destinations (``landing.py``), that place is theirs: large ones
(``_DIRECT_BYTES`` on average) are read into from the socket; a payload in ``ahead`` or
staged for small ones is copied there and hashed in one pass. No sink copy follows.

Every CHUNK and BATCH is answered with one VERDICT (``wire.py``) on this connection, in the order
the chunks arrived. Urgent ones (``wire.is_urgent``) are written at once; the others
wait for the next FINISH or ABORT, or until ``VERDICT_BATCH`` of them, or chunks of
``VERDICT_BATCH_BYTES``, are waiting: each small write on a socket costs about as much
as reading a whole chunk.

Failure rules:
- bad prefix (magic, version, kind, lengths): the stream cannot be resynchronised, so the
  connection is closed; the message's request id is unknown, nothing else is failed.
- bad header inside a good prefix: that message is skipped; if its request id could be
  read and is live, that transfer fails ("malformed message: ..."); a chunk's verdict
  says "failed".
- chunk larger than ``max_payload_bytes``: its transfer fails, the payload is skipped,
  its verdict says "failed".
- connection lost after a message's header was read but before its last byte: that
  message's transfer fails at once ("sender connection lost mid-message").
"""

from __future__ import annotations

import asyncio
import enum
import socket
from collections.abc import Callable

import structlog
import xxhash

from common.transfer import batch, wire
from common.transfer.landing import Filling, scatterer
from common.transfer.table import TransferTable
from common.transfer.tcp import ReadMark

log = structlog.get_logger("pdserve.transfer")

_AHEAD_BYTES = batch.MAX_BYTES + (64 << 10)  # a whole BATCH and its header, in place
_EXACT_BYTES = 256 << 10  # a payload larger than this is read straight into place
_SLACK_BYTES = 4096
_SCRATCH_BYTES = 1 << 20
_DIRECT_BYTES = 128 << 10  # a sink's destinations this large are read into directly
VERDICT_BATCH = 32  # verdicts held back at most, and the bytes of their chunks:
VERDICT_BATCH_BYTES = 16 << 20  # what the sender keeps until they come
_CARRIERS = (wire.Chunk, batch.Batch)  # the messages with a payload and a verdict


class _Stage(enum.Enum):
    AHEAD = "ahead"  # between messages, or inside a prefix or header
    PAYLOAD = "payload"  # the rest of a wanted payload, straight into its buffer
    DISCARD = "discard"  # the rest of an unwanted payload, into scratch
    CLOSED = "closed"


class FrameReader(asyncio.BufferedProtocol):
    """Parses one connection's messages and applies them to ``table``."""

    def __init__(
        self,
        table: TransferTable,
        max_payload_bytes: int,
        on_close: Callable[[FrameReader], None],
    ) -> None:
        self._table = table
        self._max_payload = max_payload_bytes
        self._on_close = on_close
        self._transport: asyncio.BaseTransport | None = None
        self._peer: object = None
        self._ahead = memoryview(bytearray(_AHEAD_BYTES))
        self._start = self._end = 0  # ahead[start:end] is read and not parsed yet
        self._exact = False  # read only the head in progress: the last payload was large
        self._head = wire.PREFIX.size  # how long that head is, as far as known
        self._payload = bytearray()
        self._hasher = xxhash.xxh3_64()  # of the payload read into place so far
        self._scratch = memoryview(bytearray(_SCRATCH_BYTES))
        self._carried: set[str] = set()  # transfers with chunks here and no end yet
        self._verdicts: list[bytes] = []  # encoded, not written yet
        self._verdict_bytes = 0  # payload bytes they answer for
        self._stage = _Stage.AHEAD
        self._mark = ReadMark(None)  # a TCP socket's, once connected
        self._begin_message()

    # -- asyncio.BufferedProtocol ------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        self._peer = transport.get_extra_info("peername")
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._mark = ReadMark(sock)

    def get_buffer(self, sizehint: int) -> memoryview:
        stage = self._stage
        if stage is _Stage.AHEAD:
            if self._exact:
                return self._ahead[self._end : self._start + self._head + _SLACK_BYTES]
            return self._ahead[self._end :]
        if stage is _Stage.PAYLOAD:
            if self._filling is not None:  # straight into the sink's destinations
                return self._filling.buffer
            return self._view[self._filled :]
        if stage is _Stage.DISCARD:
            return self._scratch[: min(self._discard_left, len(self._scratch))]
        return self._scratch  # CLOSED: the loop may ask once more before the close lands

    def buffer_updated(self, nbytes: int) -> None:
        stage = self._stage
        if stage is _Stage.AHEAD:
            self._end += nbytes
            self._parse()
        elif stage is _Stage.PAYLOAD:
            if self._filling is not None:
                self._landed_into(nbytes)
                return
            filled = self._filled
            self._filled = filled + nbytes
            if self._scatter is None:  # else hashed as the bytes land in their place
                self._hasher.update(self._view[filled : self._filled])
            left = len(self._view) - self._filled
            self._mark.coming(left)
            if not left:
                self._stage = _Stage.AHEAD
                self._complete(self._view, None if self._scatter else self._hasher.intdigest())
        elif stage is _Stage.DISCARD:
            self._discard_left -= nbytes
            if not self._discard_left:
                self._stage = _Stage.AHEAD
                self._complete(None)

    def _landed_into(self, nbytes: int) -> None:
        (filling := self._filling).took(nbytes)
        self._mark.coming(filling.left)
        if not filling.left:
            self._stage = _Stage.AHEAD
            self._complete(None, filling.digest())

    def eof_received(self) -> bool:
        return False  # close our side too; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        if self._stage is not _Stage.CLOSED:
            # Only a chunk its transfer admitted (its payload is being read) speaks for it.
            if self._stage is _Stage.PAYLOAD and self._message is not None:
                reason = "sender connection lost mid-message"
                self._table.fail(self._message.request_id, reason + (f": {exc}" if exc else ""))
            elif self._end > self._start:
                log.warning("kv_transfer.connection_lost_mid_message", peer=self._peer)
            # A sender that goes away leaves its transfers unfinishable: fail them now
            # rather than at lease end.
            for request_id in self._carried:
                self._table.fail(request_id, "sender connection lost")
        self._carried.clear()
        self._stage = _Stage.CLOSED
        self._on_close(self)

    def abort(self) -> None:
        """Drop the connection now, without failing the message in progress."""
        self._stage = _Stage.CLOSED
        if self._transport is not None:
            self._transport.abort()

    # -- message state machine ---------------------------------------------------------

    def _begin_message(self) -> None:
        self._kind: wire.Kind | None = None
        self._message: wire.Message | None = None
        self._verdict: wire.Verdict | None = None  # decided before the payload arrived
        self._payload_len = 0
        self._filling: Filling | None = None  # the sink's destinations, read into
        self._scatter = None  # copies a staged payload into the sink's destinations
        self._where: list | None = None  # those destinations

    def _parse(self) -> None:
        """Apply every whole message in ``ahead``; start on the payload of a message
        whose payload goes past it."""
        ahead, prefix = self._ahead, wire.PREFIX.size
        while self._stage is _Stage.AHEAD and self._end - self._start >= prefix:
            start = self._start
            try:
                kind, header_len, payload_len = wire.decode_prefix(ahead[start : start + prefix])
            except wire.WireError as exc:
                self._protocol_error(str(exc))
                return
            if kind is wire.Kind.VERDICT:
                self._protocol_error("VERDICT goes from receiver to sender, not back")
                return
            if start + prefix + header_len > self._end:
                if prefix + header_len > len(ahead):  # larger than the whole buffer
                    self._ahead = ahead = self._grown(prefix + header_len)
                self._head = prefix + header_len
                break
            self._head = prefix
            self._kind, self._payload_len = kind, payload_len
            self._start = start + prefix + header_len
            self._read_header(ahead[start + prefix : self._start])
            self._take_payload()
        if self._stage is _Stage.AHEAD:
            self._keep_unparsed()

    def _keep_unparsed(self) -> None:
        """Move the start of a message that has not all arrived to the front."""
        start, end = self._start, self._end
        if start and start < end:
            self._ahead[: end - start] = bytes(self._ahead[start:end])  # < a prefix+header
        self._start, self._end = 0, end - start

    def _grown(self, size: int) -> memoryview:
        grown = memoryview(bytearray(max(size, 2 * len(self._ahead))))
        grown[: self._end - self._start] = self._ahead[self._start : self._end]
        self._start, self._end = 0, self._end - self._start
        return grown

    def _read_header(self, raw: memoryview) -> None:
        try:
            if self._kind is wire.Kind.BATCH:
                self._message = batch.decode(raw, self._payload_len)
            else:
                self._message = wire.decode_header(self._kind, raw)
        except wire.WireError as exc:
            log.warning("kv_transfer.malformed_message", peer=self._peer, error=str(exc))
            reason = f"malformed message: {exc}"
            if exc.request_id is not None:
                self._table.fail_untokened(exc.request_id, reason)
            self._verdict = wire.Verdict(wire.Status.FAILED, reason)

    def _take_payload(self) -> None:
        """The payload follows ``ahead[start]``: apply the message if all of it is there,
        else move what is there to its place and read the rest straight after it."""
        size, message = self._payload_len, self._message
        wanted = type(message) in _CARRIERS and self._table.admits(
            message.request_id, message.token)
        if wanted and size > self._max_payload:
            self._verdict = self._table.fail(
                message.request_id,
                f"chunk of {size} bytes exceeds the {self._max_payload}-byte limit",
            )
            wanted = False
        start, have = self._start, self._end - self._start
        self._exact = size > _EXACT_BYTES
        if size <= have:
            self._start = start + size
            self._complete(self._ahead[start : start + size] if wanted else None)
            return
        self._start = self._end = 0
        if wanted and type(message) is batch.Batch and self._table.lands \
                and self._lands_directly(message, self._ahead[start : start + have]):
            return
        if wanted:
            if start + size <= len(self._ahead):  # the rest read in after it: no copy
                self._view = self._ahead[start : start + size]
            else:  # a new buffer, not a resize: a view the sink wrongly kept must not
                if len(self._payload) < size:  # make the resize fail (BufferError)
                    self._payload = bytearray(size)
                self._view = memoryview(self._payload)[:size]
                self._view[:have] = self._ahead[start : start + have]
            self._hasher = xxhash.xxh3_64(self._view[:have])  # seed 0, as wire.checksum
            self._filled = have
            self._stage = _Stage.PAYLOAD
            if size > _EXACT_BYTES:
                self._mark.payload(size - have)
        else:
            self._discard_left = size - have
            self._stage = _Stage.DISCARD

    def _lands_directly(self, message: batch.Batch, have: memoryview) -> bool:
        """A batch whose sink names large destinations (a recv apiece) is read into them,
        hashed as it lands; small ones get the staged payload copied in at the end.
        False (nothing done) where the sink names none or they are small."""
        try:
            dests = self._table.where(message)
            if dests is not None and self._payload_len >= _DIRECT_BYTES * len(dests):
                self._filling = Filling(dests, self._payload_len)
        except Exception as exc:
            log.exception("kv_transfer.sink_raised", request_id=message.request_id)
            self._verdict = self._table.fail(
                message.request_id, f"sink raised {type(exc).__name__}: {exc}")
            self._discard_left, self._stage = self._payload_len - len(have), _Stage.DISCARD
            return True
        if self._filling is None:
            if dests is not None:
                self._scatter, self._where = scatterer(True), dests
            return False
        self._stage = _Stage.PAYLOAD
        self._filling.fill(have)  # what came with the header
        self._mark.payload(self._filling.left)
        return True

    def _complete(self, payload: memoryview | None, actual: int | None = None) -> None:
        """Apply the message; ``actual``: the payload's checksum, where it was hashed as
        it came in."""
        message, verdict = self._message, self._verdict
        if type(message) in _CARRIERS and verdict is None:
            if payload is None and self._filling is None:  # not live, or refused (admits)
                if not self._table.is_live(message.request_id):
                    self._table.drop(message.request_id, "chunk")
                verdict = wire.DROPPED
            elif type(message) is batch.Batch:
                self._carried.add(message.request_id)
                verdict = self._on_batch(message, payload, actual)
            else:
                self._carried.add(message.request_id)
                verdict = self._table.on_chunk(
                    message.request_id,
                    message.layer,
                    message.block_ids,
                    payload,
                    message.checksum,
                    message.attempt,
                    message.token,
                    message.heads,
                    actual,
                )
        elif isinstance(message, wire.Finish | wire.Abort):
            self._mark.fresh = True
            if self._verdicts:  # first: the sender's finish waits for them
                self._flush_verdicts()
            self._carried.discard(message.request_id)
            if isinstance(message, wire.Finish):
                self._table.on_finish(message.request_id, message.num_chunks, message.token)
            else:
                self._table.on_abort(message.request_id, message.reason, message.token)
        if self._kind is wire.Kind.CHUNK or self._kind is wire.Kind.BATCH:
            self._verdicts.append(wire.encode_verdict(verdict))
            self._verdict_bytes += self._payload_len
            if (
                wire.is_urgent(verdict, message)
                or len(self._verdicts) >= VERDICT_BATCH
                or self._verdict_bytes >= VERDICT_BATCH_BYTES
            ):
                self._flush_verdicts()
        self._begin_message()

    def _on_batch(self, message: batch.Batch, payload: memoryview | None,
                  actual: int | None) -> wire.Verdict:
        scatter = self._scatter
        if payload is not None and scatter is not None and self._where is not None:
            try:  # staged: into the sink's destinations now, hashed in the same pass
                actual, payload = scatter(payload, self._where), None
            except Exception as exc:
                log.exception("kv_transfer.sink_raised", request_id=message.request_id)
                return self._table.fail(message.request_id,
                                        f"sink raised {type(exc).__name__}: {exc}")
        elif payload is not None and actual is None:  # whole in ``ahead``
            scatter = scatterer(self._table.lands)
        return self._table.on_batch(message, payload, actual, scatter)

    def _flush_verdicts(self) -> None:
        if not self._transport.is_closing():
            self._transport.write(b"".join(self._verdicts))
        self._verdicts.clear()
        self._verdict_bytes = 0

    def _protocol_error(self, reason: str) -> None:
        log.warning("kv_transfer.protocol_error", peer=self._peer, error=reason)
        self.abort()

