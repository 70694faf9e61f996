"""Framing of data-plane messages on a byte stream (the tcp backend; the ucx backend
sends the same prefix and header as one tagged message).

Every message is::

    prefix    20 bytes, little-endian struct "<4sBBHIQ":
              magic b"PDKV" | version u8 | kind u8 | reserved u16 (0) |
              header length u32 | payload length u64
    header    by kind:
              sender -> receiver
              CHUNK    fixed-layout binary, little-endian (the one message sent per
                       chunk: a msgpack map cost several µs to build and to read back):
                         "<QQBBHIHHH"  checksum u64 | layer u64 | attempt u8 |
                                    token length u8 | request_id length u16 |
                                    block count u32 | head start u16 |
                                    head count u16 | heads in all u16
                         request_id (UTF-8) | token | block_ids (u64 each)
                       and nothing after them. Heads all 0: every KV head; else
                       heads [start, start + count) of ``heads in all``, one TP
                       rank's slice (``Chunk.heads``, ``slices.py``)
              BATCH    several chunks of one request, one verdict (``batch.py``);
                       its payload is their bytes back to back
              the others: a msgpack map
              FINISH   {request_id: str, num_chunks: int, token: bin}
              ABORT    {request_id: str, reason: str, token: bin}
              receiver -> sender
              VERDICT  {status: str, reason: str}
    payload   CHUNK and BATCH only: the raw KV bytes; ``checksum`` is their xxh3_64 (seed 0)

Verdicts: the receiver answers every CHUNK (and BATCH), in the order the chunks arrived on the
connection, with one VERDICT (FINISH and ABORT get none). It may hold "ok" and
"dropped" back to write several at once, but no later than when it processes a FINISH
or ABORT; "resend", "failed" and the verdict on a resent chunk go at once::

    ok       verified and handed to the sink
    dropped  its transfer is not live (never expected, ended, cancelled): read and dropped
    resend   the checksum did not match on attempt 0: send the same chunk again, attempt 1
    failed   the chunk ended its transfer FAILED: checksum mismatch on the last attempt,
             sink raised, too large, malformed header; ``reason`` says which

So a payload is sent at most ``MAX_ATTEMPTS`` (2) times: one mismatch is retried, a
second fails the transfer (``reason`` starts "checksum mismatch"). The sender keeps the
payload until its verdict. A resent chunk may come after its transfer's FINISH: the
receiver settles the transfer once the chunks it asked for again are in.

``token`` is the transfer's secret: the receiver drew it when it expected the transfer
(``KVReceiver.expect(..., token=)``) and told the sender over the authenticated control
plane; a message whose token does not match (compared in constant time) is refused,
counted and changes nothing: a CHUNK is answered "dropped" and its payload never read
into the transfer. Every transfer has one.

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
VERSION = 7  # 3: token in CHUNK, FINISH and ABORT; 4: CHUNK header in binary; 5: BATCH;
# 6: head slices in CHUNK; 7: one checksum for a BATCH's whole payload
PREFIX = struct.Struct("<4sBBHIQ")
CHUNK_HEAD = struct.Struct("<QQBBHIHHH")
WHOLE = (0, 0, 0)  # Chunk.heads of a payload with every KV head
MAX_HEADS = 0xFFFF
MAX_HEADER_BYTES = 1 << 20
_U64_MAX = (1 << 64) - 1
MAX_ATTEMPTS = 2
MAX_TOKEN_BYTES = 64
MAX_REASON_CHARS = 1000
MAX_VERDICT_BYTES = PREFIX.size + 64 + 4 * (MAX_REASON_CHARS + 3)  # UTF-8: <= 4 bytes a char


class Kind(enum.IntEnum):
    CHUNK = 1
    FINISH = 2
    ABORT = 3
    VERDICT = 4
    BATCH = 5  # several chunks of one request in one message: batch.py


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
    attempt: int = 0  # 0, or 1 when the receiver asked for it again
    token: bytes = b""  # the transfer's secret, as the receiver drew it
    # (start, count, heads in all): a slice of the KV heads, or WHOLE for every head
    heads: tuple[int, int, int] = WHOLE


def check_heads(heads: object) -> str | None:
    """Why ``heads`` is not a valid ``Chunk.heads``; None if it is."""
    if heads == WHOLE:
        return None
    if (not isinstance(heads, tuple) or len(heads) != 3
            or not all(_is_uint(h, MAX_HEADS) for h in heads)):
        return f"heads must be (start, count, total) u16s, got {heads!r:.80}"
    start, count, total = heads
    if count == 0 or start + count > total:
        return f"head slice [{start}, {start + count}) outside the {total} heads"
    return None


class Finish(NamedTuple):
    request_id: str
    num_chunks: int
    token: bytes = b""


class Abort(NamedTuple):
    request_id: str
    reason: str
    token: bytes = b""


class Status(enum.StrEnum):
    OK = "ok"
    DROPPED = "dropped"
    RESEND = "resend"
    FAILED = "failed"


class Verdict(NamedTuple):
    """The receiver's answer to one chunk; ``reason`` is empty for OK."""

    status: Status
    reason: str = ""


OK = Verdict(Status.OK)
DROPPED = Verdict(Status.DROPPED)

Message = Chunk | Finish | Abort | Verdict
_KIND_OF = {Chunk: Kind.CHUNK, Finish: Kind.FINISH, Abort: Kind.ABORT, Verdict: Kind.VERDICT}
_TYPE_OF = {kind: cls for cls, kind in _KIND_OF.items()}
_STATUSES = frozenset(Status)
_KINDS = {int(kind): kind for kind in Kind}


def checksum(payload: bytes | bytearray | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def _is_uint(value: object, limit: int = _U64_MAX) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= limit


_PLAIN_INT = frozenset({int})


def _are_uints(values: list) -> bool:
    if set(map(type, values)) <= _PLAIN_INT:  # what msgpack gives: checked at C speed
        return not values or (min(values) >= 0 and max(values) <= _U64_MAX)
    return all(_is_uint(v) for v in values)


def _plain_chunk(chunk: Chunk) -> bool:
    """Whether ``chunk`` is valid with exactly the types a sender usually gives (plain
    str, int, list of int, bytes); False means only "look closer", not invalid."""
    rid, layer, blocks, checksum, attempt, token, heads = chunk
    return (heads is WHOLE and type(rid) is str and rid != ""
            and type(layer) is int and 0 <= layer <= _U64_MAX
            and type(checksum) is int and 0 <= checksum <= _U64_MAX
            and type(attempt) is int and 0 <= attempt < MAX_ATTEMPTS
            and type(token) is bytes and len(token) <= MAX_TOKEN_BYTES
            and type(blocks) is list and _are_uints(blocks))


def validate(message: Message) -> None:
    """Raise WireError unless every field of ``message`` has its spec'd type and range."""
    if type(message) is Chunk and _plain_chunk(message):
        return  # the one validated per chunk: its usual types checked in one pass
    if isinstance(message, Verdict):
        if not isinstance(message.status, str) or message.status not in _STATUSES:
            raise WireError(f"status must be one of {sorted(_STATUSES)}, got {message.status!r}")
        if not isinstance(message.reason, str):
            raise WireError(f"reason must be a string, got {message.reason!r}")
        return
    rid = message.request_id
    if not isinstance(rid, str) or not rid:
        raise WireError(f"request_id must be a non-empty string, got {rid!r}")
    token = message.token
    if not isinstance(token, bytes) or len(token) > MAX_TOKEN_BYTES:
        raise WireError(f"token must be at most {MAX_TOKEN_BYTES} bytes, got {token!r:.80}", rid)
    if isinstance(message, Chunk):
        if not _is_uint(message.layer):
            raise WireError(f"layer must be an integer >= 0, got {message.layer!r}", rid)
        blocks = message.block_ids
        if not isinstance(blocks, list) or not _are_uints(blocks):
            raise WireError(f"block_ids must be a list of integers >= 0, got {blocks!r}", rid)
        if not _is_uint(message.checksum):
            raise WireError(f"checksum must be a u64, got {message.checksum!r}", rid)
        if not _is_uint(message.attempt, MAX_ATTEMPTS - 1):
            raise WireError(
                f"attempt must be in [0, {MAX_ATTEMPTS - 1}], got {message.attempt!r}", rid
            )
        bad = check_heads(message.heads)
        if bad:
            raise WireError(bad, rid)
    elif isinstance(message, Finish):
        if not _is_uint(message.num_chunks):
            raise WireError(f"num_chunks must be an integer >= 0, got {message.num_chunks!r}", rid)
    elif not isinstance(message.reason, str):
        raise WireError(f"reason must be a string, got {message.reason!r}", rid)


def encode(message: Message, payload_len: int = 0, *, checked: bool = False) -> bytes:
    """Prefix and header of ``message``; the caller writes ``payload_len`` bytes after it.

    Validates ``message`` first unless the caller says it is ``checked`` already.
    """
    if not checked:
        validate(message)
    kind = _KIND_OF[type(message)]
    if kind is Kind.CHUNK:
        header = encode_chunk(message)
    elif payload_len:
        raise WireError(f"{kind.name} carries no payload", message.request_id)
    else:
        header = msgpack.packb(message._asdict())
    if len(header) > MAX_HEADER_BYTES:
        raise WireError(f"header of {len(header)} bytes exceeds {MAX_HEADER_BYTES}")
    return PREFIX.pack(MAGIC, VERSION, kind, 0, len(header), payload_len) + header


def decode_prefix(raw: bytes | bytearray | memoryview) -> tuple[Kind, int, int]:
    """``(kind, header length, payload length)``; WireError if the prefix is invalid."""
    if len(raw) != PREFIX.size:
        raise WireError(f"a prefix of {len(raw)} bytes, not {PREFIX.size}")
    magic, version, kind, _reserved, header_len, payload_len = PREFIX.unpack(raw)
    if magic != MAGIC:
        raise WireError(f"bad magic {magic!r}")
    if version != VERSION:
        raise WireError(f"unsupported version {version} (this side speaks {VERSION})")
    kind_ = _KINDS.get(kind)  # not Kind(kind): an enum call costs ~0.5 us a message
    if kind_ is None:
        raise WireError(f"unknown message kind {kind}")
    kind = kind_
    if not 0 < header_len <= MAX_HEADER_BYTES:
        raise WireError(f"header length {header_len} outside (0, {MAX_HEADER_BYTES}]")
    if payload_len and kind != Kind.CHUNK and kind != Kind.BATCH:
        raise WireError(f"{kind.name} with a {payload_len}-byte payload")
    return kind, header_len, payload_len


def _blocks_struct(count: int) -> struct.Struct:
    packer = _BLOCKS.get(count)
    if packer is None:
        packer = struct.Struct(f"<{count}Q")
        if len(_BLOCKS) < 1024:  # the counts a deployment uses are few
            _BLOCKS[count] = packer
    return packer


_BLOCKS: dict[int, struct.Struct] = {}


def encode_chunk(chunk: Chunk, checksum: int | None = None) -> bytes:
    """A CHUNK's binary header alone (the shm backend's chunk frames carry it too), with
    ``checksum`` in place of ``chunk.checksum`` when given (no record rebuilt per chunk)."""
    rid, blocks, token = chunk.request_id.encode(), chunk.block_ids, chunk.token
    if len(rid) > 0xFFFF:
        raise WireError(f"request_id of {len(rid)} bytes exceeds 65535", chunk.request_id)
    try:
        return (CHUNK_HEAD.pack(chunk.checksum if checksum is None else checksum, chunk.layer,
                                chunk.attempt, len(token), len(rid), len(blocks),
                                *chunk.heads)
                + rid + token + _blocks_struct(len(blocks)).pack(*blocks))
    except struct.error as exc:  # an unvalidated field out of range
        raise WireError(f"CHUNK field out of range: {exc}", chunk.request_id) from None


def encode_chunk_message(chunk: Chunk, checksum: int, payload_len: int) -> bytes:
    """``encode(chunk with checksum, payload_len, checked=True)``, for the one message
    sent per chunk."""
    header = encode_chunk(chunk, checksum)
    return PREFIX.pack(MAGIC, VERSION, Kind.CHUNK, 0, len(header), payload_len) + header


def decode_chunk(raw: bytes | bytearray | memoryview, start: int = 0) -> Chunk:
    """The Chunk the binary header ``raw[start:]`` holds, every field in range; WireError
    if it is not one."""
    size = len(raw) - start
    if size < CHUNK_HEAD.size:
        raise WireError(f"CHUNK header of {size} bytes, shorter than its fixed "
                        f"{CHUNK_HEAD.size}")
    checksum, layer, attempt, token_len, rid_len, count, *heads = \
        CHUNK_HEAD.unpack_from(raw, start)
    at = start + CHUNK_HEAD.size
    blocks_at = at + rid_len + token_len
    if blocks_at + 8 * count != len(raw):
        raise WireError(f"CHUNK header of {size} bytes, its lengths say "
                        f"{blocks_at + 8 * count - start}")
    try:
        rid = str(raw[at : at + rid_len], "utf-8")
    except UnicodeDecodeError:
        raise WireError("CHUNK request_id is not UTF-8") from None
    if not rid:
        raise WireError("request_id must be a non-empty string, got ''")
    if token_len > MAX_TOKEN_BYTES:
        raise WireError(f"token must be at most {MAX_TOKEN_BYTES} bytes", rid)
    if attempt >= MAX_ATTEMPTS:
        raise WireError(f"attempt must be in [0, {MAX_ATTEMPTS - 1}], got {attempt}", rid)
    token = bytes(raw[at + rid_len : blocks_at])
    heads = WHOLE if heads == [0, 0, 0] else tuple(heads)
    bad = check_heads(heads)
    if bad:
        raise WireError(bad, rid)
    return Chunk(rid, layer, list(_blocks_struct(count).unpack_from(raw, blocks_at)),
                 checksum, attempt, token, heads)


def decode_header(kind: Kind, raw: bytes | bytearray | memoryview) -> Message:
    """The message a header of ``kind`` holds; WireError if it is malformed."""
    if kind is Kind.CHUNK:
        return decode_chunk(raw)
    if kind is Kind.BATCH:  # needs its payload length: batch.decode
        raise WireError("a BATCH header is read by batch.decode")
    if kind is Kind.VERDICT:
        common = _VERDICT_OF.get(bytes(raw))  # almost every verdict: no msgpack
        if common is not None:
            return common
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
    if kind is Kind.VERDICT:
        message = message._replace(status=Status(message.status))
    return message


def encode_verdict(verdict: Verdict) -> bytes:
    """The whole VERDICT message (it has no payload); the common ones are built once.

    A reason longer than ``MAX_REASON_CHARS`` is cut, so that a verdict stays under
    ``MAX_VERDICT_BYTES``."""
    frame = _VERDICT_FRAMES.get(verdict)
    if frame is not None:
        return frame
    if len(verdict.reason) > MAX_REASON_CHARS:
        verdict = verdict._replace(reason=verdict.reason[:MAX_REASON_CHARS] + "...")
    return encode(verdict)


_VERDICT_FRAMES = {v: encode(v) for v in (OK, DROPPED)}
_VERDICT_OF = {frame[PREFIX.size :]: v for v, frame in _VERDICT_FRAMES.items()}
_OK_FRAME = _VERDICT_FRAMES[OK]


def split_verdicts(data: bytes | bytearray, start: int = 0, end: int | None = None):
    """The VERDICT messages that ``data[start:end]`` holds whole, and where the first
    one that is not whole begins; WireError for anything but a VERDICT."""
    end = len(data) if end is None else end
    view, verdicts, offset = memoryview(data), [], start
    while end - offset >= PREFIX.size:
        if data.startswith(_OK_FRAME, offset):  # almost every verdict
            verdicts.append(OK)
            offset += len(_OK_FRAME)
            continue
        kind, header_len, _ = decode_prefix(view[offset : offset + PREFIX.size])
        if kind is not Kind.VERDICT:
            raise WireError(f"a receiver sends only VERDICT, not {kind.name}")
        if end - offset < PREFIX.size + header_len:
            break
        offset += PREFIX.size + header_len
        verdicts.append(decode_header(kind, view[offset - header_len : offset]))
    return verdicts, offset


_URGENT = frozenset((Status.RESEND, Status.FAILED))


def is_urgent(verdict: Verdict, chunk: Chunk | None) -> bool:
    """Whether a receiver writes ``verdict`` at once rather than with the next batch:
    "resend" and "failed", and any verdict on a resent chunk (its FINISH may have
    come and flushed the batch already, and the sender waits for it)."""
    return verdict.status in _URGENT or chunk is None or chunk.attempt > 0
