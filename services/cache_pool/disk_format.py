"""On-disk formats of the SSD tier: one file per block, and an append-only index log.

Block file (``blocks/<kk>/<key:016x>.blk``, ``kk`` = the key's top byte in hex)::

    offset 0   8 bytes  magic  b"PDKVBLK1"
           8   u64      key    (must match the file name and the index)
          16   u64      length of the payload
          24   u64      xxh3_64 of the payload
          32   payload

Index log (``index.log``): the magic ``b"PDKVIDX1"`` then fixed 32-byte records, all
little-endian::

    u8 op (1 put, 2 touch, 3 delete) | 3 pad | u32 depth | u64 key | u64 length | u64 check

``check`` is xxh3_64 of the record's first 24 bytes. Replaying the log in order gives the
held blocks in recency order (a put or touch moves a key to the most recent end). A
trailing partial record is a torn write and is ignored; anything else that does not
decode (bad magic, bad check, unknown op, a touch or delete of a key not held) means the
log cannot be trusted and raises ``CorruptIndex``.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from typing import NamedTuple

import xxhash

BLOCK_MAGIC = b"PDKVBLK1"
BLOCK_HEADER = struct.Struct("<8sQQQ")
INDEX_MAGIC = b"PDKVIDX1"
RECORD = struct.Struct("<B3xIQQQ")
_RECORD_BODY = RECORD.size - 8
OP_PUT, OP_TOUCH, OP_DELETE = 1, 2, 3


class CorruptBlock(ValueError):
    """A block file that does not hold the bytes its header and the index promise."""


class CorruptIndex(ValueError):
    """An index log that cannot be replayed."""


class IndexEntry(NamedTuple):
    length: int  # payload bytes, header not included
    depth: int


class Replay(NamedTuple):
    entries: OrderedDict[int, IndexEntry]  # least recently used first
    records: int
    torn_tail: bool


def encode_block(key: int, data: bytes | bytearray | memoryview) -> bytes:
    """The header of ``data``'s block file (write it, then ``data``)."""
    return BLOCK_HEADER.pack(BLOCK_MAGIC, key, len(data), xxhash.xxh3_64_intdigest(data))


def decode_block(key: int, raw: bytes, expected_length: int) -> bytes:
    """The payload of a block file's bytes ``raw``; raises ``CorruptBlock`` if the file
    is truncated, too long, for another key, or fails its checksum."""
    if len(raw) < BLOCK_HEADER.size:
        raise CorruptBlock(f"{len(raw)} bytes is shorter than the header")
    magic, stored_key, length, checksum = BLOCK_HEADER.unpack_from(raw)
    if magic != BLOCK_MAGIC:
        raise CorruptBlock(f"bad magic {magic!r}")
    if stored_key != key:
        raise CorruptBlock(f"file holds key {stored_key:#x}")
    if length != expected_length or len(raw) - BLOCK_HEADER.size != length:
        raise CorruptBlock(f"length {len(raw) - BLOCK_HEADER.size}, header {length}, "
                           f"index {expected_length}")
    payload = raw[BLOCK_HEADER.size:]
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        raise CorruptBlock("checksum mismatch")
    return payload


def encode_record(op: int, key: int, depth: int = 0, length: int = 0) -> bytes:
    body = RECORD.pack(op, depth, key, length, 0)[:_RECORD_BODY]
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def replay_index(raw: bytes) -> Replay:
    """Decode a whole index log; see the module docstring for what raises."""
    if raw[: len(INDEX_MAGIC)] != INDEX_MAGIC:
        raise CorruptIndex(f"bad magic {raw[:len(INDEX_MAGIC)]!r}")
    body = memoryview(raw)[len(INDEX_MAGIC):]
    whole = len(body) - len(body) % RECORD.size
    entries: OrderedDict[int, IndexEntry] = OrderedDict()
    for offset in range(0, whole, RECORD.size):
        op, depth, key, length, check = RECORD.unpack_from(body, offset)
        if xxhash.xxh3_64_intdigest(body[offset:offset + _RECORD_BODY]) != check:
            raise CorruptIndex(f"record {offset // RECORD.size} fails its check")
        if op == OP_PUT:
            entries.pop(key, None)
            entries[key] = IndexEntry(length, depth)
        elif op == OP_TOUCH and key in entries:
            entries.move_to_end(key)
        elif op == OP_DELETE and key in entries:
            del entries[key]
        else:
            raise CorruptIndex(f"record {offset // RECORD.size}: op {op} on key {key:#x}")
    return Replay(entries, whole // RECORD.size, whole != len(body))
