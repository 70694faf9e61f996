"""Framing of data-plane messages on a byte stream (used by the tcp backend).

Every message is::

    prefix    20 bytes, little-endian struct "<4sBBHIQ":
              magic b"PDKV" | version u8 | kind u8 | reserved u16 (0) |
              header length u32 | payload length u64
    header    msgpack map, by kind:
              CHUNK   {request_id: str, layer: int, block_ids: [int], checksum: u64}
              FINISH  {request_id: str, num_chunks: int}
              ABORT   {request_id: str, reason: str}
    payload   CHUNK only: the raw KV bytes; ``checksum`` is their xxh3_64 (seed 0)

A bad prefix means the stream cannot be trusted past this point; a bad header inside a
good prefix spoils only that one message (its payload length is still known).
"""

from __future__ import annotations

import enum
import struct
from typing import NamedTuple

import msgpack
import xxhash

MAGIC = b"PDKV"
VERSION = 1
PREFIX = struct.Struct("<4sBBHIQ")
MAX_HEADER_BYTES = 1 << 20
_U64_MAX = (1 << 64) - 1


class Kind(enum.IntEnum):
    CHUNK = 1
    FINISH = 2
    ABORT = 3


class WireError(ValueError):
    """A message that does not follow this spec; ``request_id`` when it could be read."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class Chunk(NamedTuple):
    request_id: str
    layer: int
    block_ids: list[int]
    checksum: int


class Finish(NamedTuple):
    request_id: str
    num_chunks: int


class Abort(NamedTuple):
    request_id: str
    reason: str


Message = Chunk | Finish | Abort
_KIND_OF = {Chunk: Kind.CHUNK, Finish: Kind.FINISH, Abort: Kind.ABORT}
_TYPE_OF = {kind: cls for cls, kind in _KIND_OF.items()}


def checksum(payload: bytes | bytearray | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def _is_uint(value: object, limit: int = _U64_MAX) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= limit


def validate(message: Message) -> None:
    """Raise WireError unless every field of ``message`` has its spec'd type and range."""
    rid = message.request_id
    if not isinstance(rid, str) or not rid:
        raise WireError(f"request_id must be a non-empty string, got {rid!r}")
    if isinstance(message, Chunk):
        if not _is_uint(message.layer):
            raise WireError(f"layer must be an integer >= 0, got {message.layer!r}", rid)
        blocks = message.block_ids
        if not isinstance(blocks, list) or not all(_is_uint(b) for b in blocks):
            raise WireError(f"block_ids must be a list of integers >= 0, got {blocks!r}", rid)
        if not _is_uint(message.checksum):
            raise WireError(f"checksum must be a u64, got {message.checksum!r}", rid)
    elif isinstance(message, Finish):
        if not _is_uint(message.num_chunks):
            raise WireError(f"num_chunks must be an integer >= 0, got {message.num_chunks!r}", rid)
    elif not isinstance(message.reason, str):
        raise WireError(f"reason must be a string, got {message.reason!r}", rid)


def encode(message: Message, payload_len: int = 0) -> bytes:
    """Prefix and header of ``message``; the caller writes ``payload_len`` bytes after it."""
    validate(message)
    kind = _KIND_OF[type(message)]
    if kind is not Kind.CHUNK and payload_len:
        raise WireError(f"{kind.name} carries no payload", message.request_id)
    header = msgpack.packb(message._asdict())
    if len(header) > MAX_HEADER_BYTES:
        raise WireError(f"header of {len(header)} bytes exceeds {MAX_HEADER_BYTES}")
    return PREFIX.pack(MAGIC, VERSION, kind, 0, len(header), payload_len) + header


def decode_prefix(raw: bytes | bytearray | memoryview) -> tuple[Kind, int, int]:
    """``(kind, header length, payload length)``; WireError if the prefix is invalid."""
    magic, version, kind, _reserved, header_len, payload_len = PREFIX.unpack(raw)
    if magic != MAGIC:
        raise WireError(f"bad magic {magic!r}")
    if version != VERSION:
        raise WireError(f"unsupported version {version} (this side speaks {VERSION})")
    try:
        kind = Kind(kind)
    except ValueError:
        raise WireError(f"unknown message kind {kind}") from None
    if not 0 < header_len <= MAX_HEADER_BYTES:
        raise WireError(f"header length {header_len} outside (0, {MAX_HEADER_BYTES}]")
    if kind != Kind.CHUNK and payload_len:
        raise WireError(f"{kind.name} with a {payload_len}-byte payload")
    return kind, header_len, payload_len


def decode_header(kind: Kind, raw: bytes | bytearray | memoryview) -> Message:
    """The message a header of ``kind`` holds; WireError if it is malformed."""
    try:
        fields = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise WireError(f"undecodable {kind.name} header: {exc}") from exc
    rid = fields.get("request_id") if isinstance(fields, dict) else None
    rid = rid if isinstance(rid, str) and rid else None
    cls = _TYPE_OF[kind]
    if not isinstance(fields, dict) or set(fields) != set(cls._fields):
        raise WireError(f"{kind.name} header must hold exactly {cls._fields}", rid)
    message = cls(**fields)
    validate(message)
    return message
