"""The shm backend: same-host peers move KV through shared memory; only small control
frames cross a socket. The sender is in ``shm_sender.py``, the receiver in
``shm_receiver.py``.

Address: ``shm://host:port``, the TCP control channel the receiver listens on (loopback
by default; IPv6 hosts in brackets). Payload bytes never cross it. The receiver serves
the same frames on a Unix-domain socket named after that address as well, which a
sender uses where it can (``shm_control.py``: cheaper per message than loopback TCP).

Control frames (``control.py``: u32 length | body)::

    sender -> receiver
      hello    msgpack {t: "hello", v: 6, prefix}
                                       first frame; this connection's segments are
                                       <prefix>-<slot>-<generation> in the shm directory
      chunk    binary: "<BBHIQQ"  0xc1 | slot u8 | what u16 | generation u32 |
                                  offset u64 | length u64
               then, for what = 0, wire.py's CHUNK header (checksum, layer, attempt,
               request_id, token, block_ids); for what = 1, batch.py's BATCH header
               (several chunks of one request, their bytes back to back, one checksum and
               one verdict):
               where the payload lies, in segment <prefix>-<slot>-<generation>
      finish   msgpack {t: "finish", request_id, num_chunks, token}
      abort    msgpack {t: "abort", request_id, reason, token}
    receiver -> sender
      verdict  msgpack {t: "verdict", slot, status, reason}
                                       the receiver is done with the bytes of the
                                       oldest chunk in that slot it had not answered;
                                       what became of that chunk (wire.Verdict: ok,
                                       dropped, resend, failed)

Version 3 made the chunk frame binary (version 2 sent it as a msgpack map with the
segment's name): it is the one frame sent per chunk. Version 4 adds the batch (what = 1),
which ``send_many`` sends: one frame, one wake-up and one verdict for a request's layers.
Version 5 carries head slices in the CHUNK header; version 6 gives a batch one checksum
for its whole payload (``batch.py``).

The receiver answers chunks in the order they came, in one write for all the frames
that one read brought.

The ring: each sender connection owns up to ``slots`` reusable segments. Chunks are
placed in a slot's segment one after another (at page boundaries) while they fit, so
small chunks share one; a slot is reused once every chunk in it is answered. A send
waits for room while no slot can take its chunk or the bytes in flight would pass the
sender's ``max_in_flight_bytes`` (backpressure: a receiver that falls behind holds its
senders back, and nothing buffers without bound); its verdict comes later. On "resend"
the sender stages the caller's payload again (wherever there is room) as attempt 1.
The sender copies the payload into its slot, hashing it in the same pass
(``kernels/cpu_copysum.py`` where torch is loaded). The receiver, where its sink names
where a chunk belongs (``base.LandingSink``) and the kernel is built, copies it out of the
segment there, hashing what lands in the same pass, and tells the sink it is valid only
once the checksum matched (a mismatch leaves the bytes in that place, never ``landed``);
otherwise it verifies the segment and hands the sink a read-only view of it.

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

import struct
from typing import NamedTuple

from common.transfer import batch, control, wire

SCHEME = "shm"
VERSION = 6  # 3: the chunk frame is binary; 4: batches; 5: head slices in the CHUNK header;
# 6: one checksum for a batch (batch.py)
MAX_SLOTS = 64
CHUNK_PLACE = struct.Struct("<BBHIQQ")  # BINARY, slot, what, generation, offset, length
BATCHED = 1  # "what" of a batch frame


class Placed(NamedTuple):
    """A chunk frame: the chunk, and where in the sender's segments its payload lies."""

    chunk: wire.Chunk | batch.Batch
    slot: int
    generation: int
    offset: int
    length: int


def chunk_frame(chunk: wire.Chunk | batch.Batch, slot: int, generation: int, offset: int,
                length: int, checksum: int | None = None) -> bytes:
    """The whole frame of a chunk placed at ``offset`` of segment ``slot``/``generation``
    (``chunk`` validated by the caller; ``checksum`` in place of its own when given)."""
    if type(chunk) is batch.Batch:
        body = (CHUNK_PLACE.pack(control.BINARY, slot, BATCHED, generation, offset, length)
                + batch.encode(chunk, checksum, length))
    else:
        body = (CHUNK_PLACE.pack(control.BINARY, slot, 0, generation, offset, length)
                + wire.encode_chunk(chunk, checksum))
    if len(body) > control.MAX_FRAME_BYTES:
        raise control.ControlError(f"chunk frame of {len(body)} bytes exceeds "
                                   f"{control.MAX_FRAME_BYTES}", chunk.request_id)
    return control.LENGTH.pack(len(body)) + body


def read_chunk(body: bytes) -> Placed:
    """The chunk frame ``body`` holds (control.BINARY first); ControlError, with the
    request id when it could be read, if it is malformed."""
    if len(body) < CHUNK_PLACE.size:
        raise control.ControlError(f"chunk frame of {len(body)} bytes, shorter than its "
                                   f"fixed {CHUNK_PLACE.size}")
    _, slot, what, generation, offset, length = CHUNK_PLACE.unpack_from(body)
    try:
        if what == BATCHED:
            chunk = batch.decode(body, length, CHUNK_PLACE.size)
        else:
            chunk = wire.decode_chunk(body, CHUNK_PLACE.size)
    except wire.WireError as exc:
        raise control.ControlError(f"chunk frame: {exc}", exc.request_id) from None
    if slot >= MAX_SLOTS or what > BATCHED:
        raise control.ControlError(f"chunk frame: slot {slot} not under {MAX_SLOTS}, or "
                                   f"what {what} not 0 or 1", chunk.request_id)
    return Placed(chunk, slot, generation, offset, length)


def verdict_frame(slot: int, verdict: wire.Verdict) -> bytes:
    return control.pack("verdict", slot=slot, status=verdict.status.value, reason=verdict.reason)


def read_verdict(fields: dict | bytes) -> tuple[int, wire.Verdict]:
    """``(slot, verdict)`` of a verdict frame; ControlError if it is not one."""
    if isinstance(fields, bytes):
        raise control.ControlError("unexpected binary record: a receiver sends verdicts")
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
