"""Small control frames on a byte stream, for backends whose bulk bytes travel elsewhere.

Every frame is::

    length   4 bytes, little-endian u32, 1 .. MAX_FRAME_BYTES
    body     msgpack map with string keys; key "t" names the message type, or
             a binary record: first byte BINARY (0xc1, which msgpack never uses), then
             a layout its backend defines (shm's chunk frame: the one sent per chunk,
             where building and reading a msgpack map cost several µs)

The payload-carrying messages reuse ``wire.py``'s records for their fields
(``message`` below builds and validates them), so every backend accepts and rejects the
same request ids, layers, block ids and checksums.
"""

from __future__ import annotations

import functools
import struct

import msgpack

from common.transfer import wire

LENGTH = struct.Struct("<I")
BINARY = 0xC1
MAX_FRAME_BYTES = 1 << 20


class ControlError(ValueError):
    """A frame that does not follow this spec; ``request_id`` when it could be read."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


def pack(kind: str, **fields: object) -> bytes:
    """One frame of type ``kind``; ControlError if it would exceed MAX_FRAME_BYTES."""
    body = msgpack.packb({"t": kind, **fields})
    if len(body) > MAX_FRAME_BYTES:
        raise ControlError(f"{kind} frame of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    return LENGTH.pack(len(body)) + body


class FrameParser:
    """Splits a byte stream into frames, for protocols fed by ``data_received``.

    ``feed`` returns the maps of the frames completed so far; ``pending`` is True while
    part of a frame is buffered. ControlError for a bad frame: the stream is then unusable.
    A frame that is a key of ``known`` (whole, length included) comes out as its value,
    unparsed: a protocol's most common frames then cost no msgpack. A binary record
    comes out as its body (``bytes``, BINARY first) for the protocol to read.
    """

    def __init__(self, known: dict[bytes, object] | None = None) -> None:
        self._buffer = bytearray()
        self._known = known or {}

    @property
    def pending(self) -> bool:
        return bool(self._buffer)

    def feed(self, data: bytes) -> list:
        buffer, known = self._buffer, self._known
        if not buffer and type(data) is bytes:
            return self._feed_whole(data)
        buffer += data
        frames, offset = [], 0
        while len(buffer) - offset >= LENGTH.size:
            (length,) = LENGTH.unpack_from(buffer, offset)
            _check_length(length)
            end = offset + LENGTH.size + length
            if end > len(buffer):
                break
            value = known.get(bytes(buffer[offset:end])) if known else None
            if value is None:
                body = buffer[offset + LENGTH.size : end]
                value = bytes(body) if body[0] == BINARY else unpack(body)
            frames.append(value)
            offset = end
        del buffer[:offset]
        return frames

    def _feed_whole(self, data: bytes) -> list:
        """``feed`` with nothing buffered (the usual read: whole frames): each frame's body
        sliced out of ``data`` once, not copied into the buffer and out again."""
        known, frames, offset, size = self._known, [], 0, len(data)
        unpack_length = LENGTH.unpack_from
        while size - offset >= LENGTH.size:
            (length,) = unpack_length(data, offset)
            _check_length(length)
            end = offset + LENGTH.size + length
            if end > size:
                break
            value = known.get(data[offset:end]) if known else None
            if value is None:
                body = data[offset + LENGTH.size : end]
                value = body if body[0] == BINARY else unpack(body)
            frames.append(value)
            offset = end
        if offset < size:
            self._buffer += data[offset:]
        return frames


def unpack(body: bytes | bytearray) -> dict:
    """The map of one frame's body; ControlError if it is not one."""
    try:
        fields = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ControlError(f"undecodable frame: {exc}") from exc
    if not isinstance(fields, dict) or not isinstance(fields.get("t"), str):
        raise ControlError("frame must be a map with a string 't'")
    return fields


def pack_binary(body: bytes) -> bytes:
    """One frame of a binary record ``body`` (BINARY first)."""
    if not body or body[0] != BINARY or len(body) > MAX_FRAME_BYTES:
        raise ControlError(f"not a binary record of at most {MAX_FRAME_BYTES} bytes")
    return LENGTH.pack(len(body)) + body


def _check_length(length: int) -> None:
    if not 0 < length <= MAX_FRAME_BYTES:
        raise ControlError(f"frame length {length} outside (0, {MAX_FRAME_BYTES}]")


def message(fields: dict, cls: type[wire.Message], extra: tuple[str, ...] = ()) -> wire.Message:
    """Build and validate the ``wire`` record ``cls`` from a frame's fields.

    The frame must hold exactly ``t``, ``cls``'s fields and ``extra`` (which the caller
    reads itself). Raises ControlError, with the request id when it could be read.
    """
    wanted = _keys(cls, extra)
    if fields.keys() != wanted:
        raise ControlError(
            f"{fields['t']} frame must hold exactly {sorted(wanted)}", _request_id(fields)
        )
    record = cls._make(map(fields.__getitem__, cls._fields))
    try:
        wire.validate(record)
    except wire.WireError as exc:
        raise ControlError(str(exc), _request_id(fields)) from None
    return record


_FINISH_KEYS = frozenset({"t", *wire.Finish._fields})
_U64_MAX = (1 << 64) - 1


def finish(fields: dict) -> wire.Finish:
    """``message(fields, wire.Finish)``: the FINISH a frame holds, validated. Its usual
    types (plain str, int and bytes) are checked here in one expression, once a request;
    anything else takes ``message``'s general path and its errors."""
    rid, num_chunks, token = (fields.get("request_id"), fields.get("num_chunks"),
                              fields.get("token"))
    if (fields.keys() == _FINISH_KEYS and type(rid) is str and rid
            and type(num_chunks) is int and 0 <= num_chunks <= _U64_MAX
            and type(token) is bytes and len(token) <= wire.MAX_TOKEN_BYTES):
        return wire.Finish(rid, num_chunks, token)
    return message(fields, wire.Finish)


@functools.cache  # a few message types: not a set built a frame
def _keys(cls: type[wire.Message], extra: tuple[str, ...]) -> frozenset[str]:
    return frozenset({"t", *cls._fields, *extra})


def _request_id(fields: dict) -> str | None:
    rid = fields.get("request_id")
    return rid if isinstance(rid, str) and rid else None


def uint(fields: dict, name: str, limit: int = (1 << 64) - 1) -> int:
    """``fields[name]`` as an integer in [0, limit]; ControlError otherwise."""
    value = fields.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= limit:
        raise ControlError(
            f"{name} must be an integer in [0, {limit}], got {value!r}", _request_id(fields)
        )
    return value
