"""Receiving side of one stream connection: bytes in, ``TransferTable`` calls out.

A ``BufferedProtocol`` rather than a ``StreamReader``: the event loop ``recv_into``s
straight into this reader's buffers, so a payload reaches the sink without passing
through an intermediate stream buffer or a ``bytes`` copy. Per connection it holds::

    prefix   20 bytes               the fixed part of every message (see wire.py)
    header   header length bytes    fresh per message (small)
    payload  largest chunk so far   reused; grown, never shrunk, while the connection lives
    scratch  1 MiB                  sink for payloads nobody wants (unknown request id)

Failure rules:
- bad prefix (magic, version, kind, lengths): the stream cannot be resynchronised, so the
  connection is closed; the message's request id is unknown, nothing else is failed.
- bad header inside a good prefix: that message is skipped; if its request id could be
  read and is live, that transfer fails ("malformed message: ...").
- chunk larger than ``max_payload_bytes``: its transfer fails, the payload is skipped.
- connection lost after a message's header was read but before its last byte: that
  message's transfer fails at once ("sender connection lost mid-message").
"""

from __future__ import annotations

import asyncio
import enum
import socket
from collections.abc import Callable

import structlog

from common.transfer import wire
from common.transfer.table import TransferTable

log = structlog.get_logger("pdserve.transfer")

_SCRATCH_BYTES = 1 << 20


class _Stage(enum.Enum):
    PREFIX = "prefix"
    HEADER = "header"
    PAYLOAD = "payload"
    DISCARD = "discard"
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
        self._prefix = memoryview(bytearray(wire.PREFIX.size))
        self._payload = bytearray()
        self._scratch = memoryview(bytearray(_SCRATCH_BYTES))
        self._carried: set[str] = set()  # transfers with chunks here and no end yet
        self._begin_message()

    # -- asyncio.BufferedProtocol ------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        self._peer = transport.get_extra_info("peername")
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._stage is _Stage.CLOSED:
            return self._scratch  # the loop may ask once more before the close lands
        return self._view[self._filled :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._stage is _Stage.CLOSED:
            return
        self._filled += nbytes
        if self._filled == len(self._view):
            self._advance()

    def eof_received(self) -> bool:
        return False  # close our side too; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        mid_message = self._stage is not _Stage.PREFIX or self._filled > 0
        if self._stage is not _Stage.CLOSED and mid_message:
            if self._message is not None:
                reason = "sender connection lost mid-message"
                self._table.fail(self._message.request_id, reason + (f": {exc}" if exc else ""))
            else:
                log.warning("kv_transfer.connection_lost_mid_message", peer=self._peer)
        if self._stage is not _Stage.CLOSED:
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

    def _into(self, view: memoryview) -> None:
        self._view = view
        self._filled = 0

    def _begin_message(self) -> None:
        self._stage = _Stage.PREFIX
        self._kind: wire.Kind | None = None
        self._message: wire.Message | None = None
        self._payload_len = 0
        self._into(self._prefix)

    def _advance(self) -> None:
        stage = self._stage
        if stage is _Stage.PREFIX:
            try:
                self._kind, header_len, self._payload_len = wire.decode_prefix(self._prefix)
            except wire.WireError as exc:
                self._protocol_error(str(exc))
                return
            self._stage = _Stage.HEADER
            self._into(memoryview(bytearray(header_len)))
        elif stage is _Stage.HEADER:
            try:
                self._message = wire.decode_header(self._kind, self._view)
            except wire.WireError as exc:
                log.warning("kv_transfer.malformed_message", peer=self._peer, error=str(exc))
                if exc.request_id is not None:
                    self._table.fail(exc.request_id, f"malformed message: {exc}")
            self._start_payload()
        elif stage is _Stage.PAYLOAD:
            self._complete(self._view)
        elif stage is _Stage.DISCARD:
            self._discard_left -= len(self._view)
            if self._discard_left:
                self._into(self._scratch[: min(self._discard_left, len(self._scratch))])
            else:
                self._complete(None)

    def _start_payload(self) -> None:
        size, message = self._payload_len, self._message
        wanted = isinstance(message, wire.Chunk) and self._table.is_live(message.request_id)
        if wanted and size > self._max_payload:
            self._table.fail(
                message.request_id,
                f"chunk of {size} bytes exceeds the {self._max_payload}-byte limit",
            )
            wanted = False
        if size == 0:
            self._complete(memoryview(b"") if wanted else None)
        elif wanted:
            if len(self._payload) < size:
                # A new buffer rather than a resize: a view the sink wrongly kept must
                # not make the resize fail with BufferError.
                self._payload = bytearray(size)
            self._stage = _Stage.PAYLOAD
            self._into(memoryview(self._payload)[:size])
        else:
            self._stage = _Stage.DISCARD
            self._discard_left = size
            self._into(self._scratch[: min(size, len(self._scratch))])

    def _complete(self, payload: memoryview | None) -> None:
        message = self._message
        if isinstance(message, wire.Chunk):
            if payload is None:
                self._table.drop(message.request_id, "chunk")
            else:
                self._carried.add(message.request_id)
                self._table.on_chunk(
                    message.request_id,
                    message.layer,
                    message.block_ids,
                    payload,
                    message.checksum,
                )
        elif isinstance(message, wire.Finish):
            self._carried.discard(message.request_id)
            self._table.on_finish(message.request_id, message.num_chunks)
        elif isinstance(message, wire.Abort):
            self._carried.discard(message.request_id)
            self._table.on_abort(message.request_id, message.reason)
        if self._stage is not _Stage.CLOSED:
            self._begin_message()

    def _protocol_error(self, reason: str) -> None:
        log.warning("kv_transfer.protocol_error", peer=self._peer, error=reason)
        self.abort()
