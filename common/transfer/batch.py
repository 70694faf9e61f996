"""A BATCH: several chunks of one request as one message (wire version 7; ``wire.py``
has the prefix and the other kinds, ``shm.py`` the shm frame that carries it).

Per-message costs (a header built and read, a token compared, a verdict written and
read, a wake-up) bound small payloads, so a sender that has several chunks of a request
at hand (``KVSender.send_many``) sends them as one message: one header, one token check,
one checksum, one verdict, one receiver wake-up; each chunk keeps its own sink call and
counts as one chunk towards FINISH. Header, little-endian::

    "<BBHIQ"  attempt u8 | token length u8 | request_id length u16 | chunk count u32 |
              checksum u64 (xxh3_64, seed 0, of the whole payload)
    request_id (UTF-8) | token
    per chunk "<QQQ"  layer | byte length | block count
    block_ids          u64 each, every chunk's in turn
    and nothing after them

The payload is the chunks' bytes back to back, in that order; its length (the prefix's
payload length, or the shm frame's) must be the sum of the byte lengths. One checksum
covers every byte of it: the sender hashes each chunk as it goes out (xxh3 streams, so
that is the hash of the payload; the shm sender's kernel folds each stripe in as it copies
it, ``kernels/cpu_copysum.py``), the receiver hashes the payload in one call where it
lies. The verdict covers the whole batch: "ok" once the payload is verified and every
chunk handed to the sink (the checksum is checked before the first sink call, so a
"resend" has changed nothing); "resend" asks for the whole batch again (attempt 1, same
checksum); "failed" as for a chunk. A batch holds 1 to ``MAX_CHUNKS`` chunks.

Version 5 had a checksum per chunk: 30 hash calls on each side for a request's layers,
where one covers the same bytes.
"""

from __future__ import annotations

import array
import dataclasses
import itertools
import operator
import struct
import sys
from typing import NamedTuple

import xxhash

from common.transfer.wire import (
    MAX_ATTEMPTS,
    MAX_TOKEN_BYTES,
    WireError,
    _blocks_struct,
)

HEAD = struct.Struct("<BBHIQ")
MAX_CHUNKS = 128  # a request's layers and more, well under a sendmsg's IOV_MAX
MAX_BYTES = 4 << 20  # send_many groups chunks up to this; a larger chunk goes alone
_ENTRY = 3  # u64 fields per chunk
_BIG_ENDIAN = sys.byteorder == "big"  # the wire is little-endian
NBYTES = operator.attrgetter("nbytes")
_VIEW, _FLAT = frozenset({memoryview}), frozenset({("B", 1, True)})
_LAYOUT = operator.attrgetter("format", "ndim", "c_contiguous")


class Batch(NamedTuple):
    request_id: str
    layers: list[int]
    block_ids: list[list[int]]
    checksum: int  # of the whole payload; 0 until the sender computes it
    sizes: list[int]
    attempt: int = 0
    token: bytes = b""


def encode(batch: Batch, checksum: int, payload_len: int) -> bytes:
    """The BATCH header alone, with ``checksum`` (of the whole payload) in place of its own."""
    rid, token, count = batch.request_id.encode(), batch.token, len(batch.layers)
    if not (rid and len(rid) <= 0xFFFF and len(token) <= MAX_TOKEN_BYTES
            and 0 < count <= MAX_CHUNKS and sum(batch.sizes) == payload_len):
        raise WireError("BATCH request_id, token, chunk count or sizes out of range",
                        batch.request_id)
    runs = batch.block_ids
    try:
        if len(runs) != count or len(batch.sizes) != count:
            raise ValueError("a layer, size and block list for every chunk")
        # The columns interleaved at C speed (a u64 array, stored little-endian), not
        # through a list of 3 x count Python ints.
        entries = array.array("Q", bytes(8 * _ENTRY * count))
        entries[0::_ENTRY] = array.array("Q", batch.layers)
        entries[1::_ENTRY] = array.array("Q", batch.sizes)
        entries[2::_ENTRY] = array.array("Q", map(len, runs))
        if _BIG_ENDIAN:
            entries.byteswap()
        if runs.count(runs[0]) == count:  # a request's layers: one block list (C-speed count)
            blocks = _blocks_struct(len(runs[0])).pack(*runs[0]) * count
        else:
            flat = [b for run in runs for b in run]
            blocks = _blocks_struct(len(flat)).pack(*flat)
    except (struct.error, OverflowError, TypeError, ValueError) as exc:
        raise WireError(f"BATCH field out of range: {exc}", batch.request_id) from None
    try:
        head = HEAD.pack(batch.attempt, len(token), len(rid), count, checksum)
    except struct.error as exc:
        raise WireError(f"BATCH field out of range: {exc}", batch.request_id) from None
    return head + rid + token + entries.tobytes() + blocks


def decode(raw: bytes | bytearray | memoryview, payload_len: int, start: int = 0) -> Batch:
    """The Batch the header ``raw[start:]`` holds, for a payload of ``payload_len`` bytes,
    every field in range; WireError (with the request id once read) if it is not one."""
    size = len(raw) - start
    if size < HEAD.size:
        raise WireError(f"BATCH header of {size} bytes, shorter than its fixed {HEAD.size}")
    attempt, token_len, rid_len, count, checksum = HEAD.unpack_from(raw, start)
    at = start + HEAD.size
    entries_at = at + rid_len + token_len
    try:
        rid = str(raw[at : at + rid_len], "utf-8")
    except UnicodeDecodeError:
        raise WireError("BATCH request_id is not UTF-8") from None
    if not rid:
        raise WireError("request_id must be a non-empty string, got ''")
    if not 0 < count <= MAX_CHUNKS:
        raise WireError(f"BATCH of {count} chunks, not 1 to {MAX_CHUNKS}", rid)
    if token_len > MAX_TOKEN_BYTES:
        raise WireError(f"token must be at most {MAX_TOKEN_BYTES} bytes", rid)
    if attempt >= MAX_ATTEMPTS:
        raise WireError(f"attempt must be in [0, {MAX_ATTEMPTS - 1}], got {attempt}", rid)
    blocks_at = entries_at + 8 * _ENTRY * count
    if blocks_at > len(raw):
        raise WireError(f"BATCH header of {size} bytes, too short for {count} chunks", rid)
    entries = array.array("Q")
    entries.frombytes(raw[entries_at:blocks_at])  # one copy, at C speed
    if _BIG_ENDIAN:
        entries.byteswap()
    counts = entries[2::_ENTRY]
    first = counts[0]
    # Every chunk with as many blocks (a request's layers), seen comparing bytes: summing
    # or counting the array makes an int object per item.
    same_counts = counts.tobytes() == counts[:1].tobytes() * count
    total_blocks = first * count if same_counts else sum(counts)
    if blocks_at + 8 * total_blocks != len(raw):
        raise WireError(f"BATCH header of {size} bytes, its lengths say "
                        f"{blocks_at + 8 * total_blocks - start}", rid)
    sizes = entries[1::_ENTRY].tolist()
    if sum(sizes) != payload_len:
        raise WireError(f"BATCH chunks of {sum(sizes)} bytes in a {payload_len}-byte payload",
                        rid)
    if first and same_counts \
            and bytes(raw[blocks_at : blocks_at + 8 * first]) * count == bytes(raw[blocks_at:]):
        # Every chunk names the same blocks (a request's layers): unpacked once, a list
        # of its own for each chunk all the same.
        run = _blocks_struct(first).unpack_from(raw, blocks_at)
        runs = list(map(list, itertools.repeat(run, count)))  # at C speed
    else:
        flat = _blocks_struct(total_blocks).unpack_from(raw, blocks_at)
        runs, begin = [], 0
        for n in counts:
            runs.append(list(flat[begin : begin + n]))
            begin += n
    return Batch(rid, entries[0::_ENTRY].tolist(), runs, checksum, sizes, attempt,
                 bytes(raw[at + rid_len : entries_at]))


def checksum(views: list[memoryview]) -> int:
    """The BATCH checksum of a payload given as its chunks: ``wire.checksum`` of their
    bytes back to back, without joining them."""
    hasher = xxhash.xxh3_64()  # seed 0, as wire.checksum
    for view in views:
        hasher.update(view)
    return hasher.intdigest()


def groups(items: list, max_bytes: int = MAX_BYTES) -> list[list]:
    """``items`` (``(layer, blocks, view)``) in runs of at most ``MAX_CHUNKS`` chunks and
    ``max_bytes`` bytes; a chunk larger than that is a run of its own."""
    runs, run, held = [], [], 0
    for item in items:
        nbytes = item[2].nbytes
        if run and (held + nbytes > max_bytes or len(run) >= MAX_CHUNKS):
            runs.append(run)
            run, held = [], 0
        run.append(item)
        held += nbytes
    if run:
        runs.append(run)
    return runs


@dataclasses.dataclass(frozen=True, slots=True)
class Run:
    """``send_many``'s chunks checked as columns, when they make one batch as they are;
    iterated, each chunk's ``(layer, block_ids, view)``, as ``connections._items`` gives
    otherwise."""

    layers: list[int]
    blocks: list[int]  # the one block list every chunk shares
    views: list[memoryview]
    sizes: list[int]

    def __iter__(self):
        return zip(self.layers, [self.blocks] * len(self.layers), self.views, strict=True)


def flat_views(payloads) -> bool:
    """Whether every one of ``payloads`` is a flat, contiguous memoryview of bytes
    already (what a chunk's payload must become), checked at C speed for the list."""
    return set(map(type, payloads)) == _VIEW and set(map(_LAYOUT, payloads)) == _FLAT
