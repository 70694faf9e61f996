"""The shm receiver's usual read, one BATCH and its FINISH, on its short paths: the frame
parser slicing a whole read without buffering it, the FINISH's fields checked in one
expression, a BATCH whose chunks name the same blocks decoded once. Each gives the same
values and refuses the same hostile bytes as the general path."""

from __future__ import annotations

import os
import secrets

import msgpack
import pytest
import xxhash

from common.transfer import batch as batch_mod
from common.transfer import control, wire
from common.transfer.shm import OK_FRAMES, chunk_frame
from common.transfer.shm_receiver import ShmReceiver, _Peer
from common.transfer.shm_segment import Segment, new_prefix, segment_name

pytestmark = pytest.mark.timeout(60)
TOKEN = secrets.token_bytes(16)


def test_a_whole_read_parses_as_the_buffered_path_does():
    binary = control.pack_binary(bytes([control.BINARY]) + b"abc")
    finish = control.pack("finish", request_id="r", num_chunks=3, token=b"t")
    known = {binary: "known"}
    data = binary + finish
    assert control.FrameParser().feed(data) == [binary[4:], {"t": "finish", "request_id": "r",
                                                              "num_chunks": 3, "token": b"t"}]
    assert control.FrameParser(known).feed(data)[0] == "known"
    # bytearray input takes the buffered path: the same frames
    assert control.FrameParser().feed(bytearray(data)) == control.FrameParser().feed(data)
    parser = control.FrameParser()  # a read that ends inside a frame keeps the rest
    assert parser.feed(data[:-2]) == [binary[4:]] and parser.pending
    assert parser.feed(data[-2:])[0]["num_chunks"] == 3 and not parser.pending


@pytest.mark.parametrize("data", [control.LENGTH.pack(0) + b"x",
                                  control.LENGTH.pack(control.MAX_FRAME_BYTES + 1)])
def test_a_whole_read_with_a_bad_length_is_refused(data):
    with pytest.raises(control.ControlError, match="frame length"):
        control.FrameParser().feed(data)


def test_a_plain_finish_is_its_record():
    fields = {"t": "finish", "request_id": "req-1", "num_chunks": 30, "token": TOKEN}
    assert control.finish(fields) == wire.Finish("req-1", 30, TOKEN)
    assert control.finish(fields) == control.message(fields, wire.Finish)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"num_chunks": True}, "num_chunks"),
        ({"num_chunks": -1}, "num_chunks"),
        ({"num_chunks": 1 << 64}, "num_chunks"),
        ({"token": "text"}, "token"),
        ({"token": b"x" * (wire.MAX_TOKEN_BYTES + 1)}, "token"),
        ({"extra": 1}, "must hold exactly"),
        ({"request_id": ""}, "request_id"),
    ],
)
def test_a_hostile_finish_is_refused_as_before(change, match):
    fields = {"t": "finish", "request_id": "req-1", "num_chunks": 30, "token": TOKEN, **change}
    with pytest.raises(control.ControlError, match=match):
        control.finish(fields)
    with pytest.raises(control.ControlError, match=match):
        control.message(fields, wire.Finish)


def test_a_batch_of_the_same_blocks_decodes_to_lists_of_their_own():
    message = batch_mod.Batch("r", [0, 1, 2], [[4, 9]] * 3, 0, [8, 8, 8], 0, TOKEN)
    decoded = batch_mod.decode(batch_mod.encode(message, 7, 24), 24)
    assert decoded.block_ids == [[4, 9], [4, 9], [4, 9]] and decoded.checksum == 7
    assert len({id(run) for run in decoded.block_ids}) == 3
    decoded.block_ids[0].append(1)  # a sink that edits one chunk's list edits only it
    assert decoded.block_ids[1] == [4, 9]


class _Landing:
    """A sink with destinations: every layer's bytes at ``layer x size`` of one buffer."""

    def __init__(self) -> None:
        self.buffer, self.landed = bytearray(4 * 4096), []

    def __call__(self, rid, layer, blocks, payload) -> None:
        self.buffer[layer * 4096 : (layer + 1) * 4096] = payload

    def landing_many(self, rid, layers, blocks, sizes):
        view = memoryview(self.buffer)
        return [view[at * n : (at + 1) * n] for at, n in zip(layers, sizes, strict=True)]

    def landed_many(self, rid, layers, blocks, sizes) -> None:
        self.landed.append((rid, list(layers), [list(b) for b in blocks]))


class _Transport:
    def __init__(self) -> None:
        self.written, self.aborted = [], False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def is_closing(self) -> bool:
        return self.aborted

    def abort(self) -> None:
        self.aborted = True

    def get_extra_info(self, name):
        return None


@pytest.fixture
async def peer(tmp_path):
    sink = _Landing()
    rx = ShmReceiver(sink=sink, directory=str(tmp_path))
    rx._listening = True  # driven straight, not served
    peer = _Peer(rx)
    peer.connection_made(_Transport())
    prefix = new_prefix()
    segment = Segment.create(str(tmp_path), segment_name(prefix, 0, 0), 1 << 16)
    peer.data_received(control.pack("hello", v=6, prefix=prefix))
    yield peer, rx, sink, segment
    peer.end("test over")
    segment.close()


def _request(segment: Segment, rid: str, num_chunks: int = 4, **finish) -> tuple[bytes, bytes]:
    payload = os.urandom(4 * 4096)
    segment.view[: len(payload)] = payload
    message = batch_mod.Batch(rid, [0, 1, 2, 3], [[5, 7]] * 4, 0, [4096] * 4, 0, TOKEN)
    fields = {"request_id": rid, "num_chunks": num_chunks, "token": TOKEN, **finish}
    return payload, (chunk_frame(message, 0, 0, 0, len(payload),
                                 xxhash.xxh3_64_intdigest(payload))
                     + control.pack("finish", **fields))


async def test_one_read_of_a_batch_and_its_finish_lands_and_ends_the_transfer(peer):
    peer, rx, sink, segment = peer
    transfer = rx.expect("req-1", 30.0, TOKEN)
    payload, data = _request(segment, "req-1")
    peer.data_received(data)
    assert transfer.state.value == "done", transfer.error
    assert (transfer.chunks_received, transfer.bytes_received) == (4, 4 * 4096)
    assert bytes(sink.buffer) == payload
    assert b"".join(peer.transport.written) == OK_FRAMES[0]
    assert rx.table.live() == 0 and not peer.transport.aborted
    if sink.landed:  # where the copy-and-checksum kernel is built
        assert sink.landed == [("req-1", [0, 1, 2, 3], [[5, 7]] * 4)]


async def test_a_finish_miscounting_its_chunks_fails_the_transfer(peer):
    peer, rx, sink, segment = peer
    transfer = rx.expect("req-2", 30.0, TOKEN)
    _, data = _request(segment, "req-2", num_chunks=5)
    peer.data_received(data)
    assert transfer.state.value == "failed" and transfer.error == "expected 5 chunks, got 4"


async def test_a_hostile_finish_in_the_same_read_is_refused_and_ends_nothing(peer):
    peer, rx, sink, segment = peer
    transfer = rx.expect("req-3", 30.0, TOKEN)
    _, data = _request(segment, "req-3", num_chunks=True)
    peer.data_received(data)
    assert peer.transport.aborted and rx.refused == 1
    assert transfer.state.value == "transferring" and transfer.chunks_received == 4
    peer.connection_lost(None)  # the connection ends: the transfer it carried fails
    assert transfer.state.value == "failed" and transfer.error.startswith("sender protocol error")


def test_the_finish_frame_is_plain_msgpack():
    frame = control.pack("finish", request_id="r", num_chunks=1, token=b"t")
    assert msgpack.unpackb(frame[4:]) == {"t": "finish", "request_id": "r", "num_chunks": 1,
                                          "token": b"t"}


def test_a_batch_whose_equal_block_counts_overrun_its_header_is_refused():
    message = batch_mod.Batch("r", [0, 1], [[4, 9], [4, 9]], 0, [8, 8], 0, TOKEN)
    raw = bytearray(batch_mod.encode(message, 7, 16))
    blocks_at = batch_mod.HEAD.size + 1 + len(TOKEN) + 8 * 3 * 2
    for entry in (0, 1):  # both chunks claim 2**40 blocks: equal counts, far too many
        at = batch_mod.HEAD.size + 1 + len(TOKEN) + 8 * (3 * entry + 2)
        raw[at : at + 8] = (1 << 40).to_bytes(8, "little")
    with pytest.raises(wire.WireError, match="its lengths say") as caught:
        batch_mod.decode(bytes(raw), 16)
    assert caught.value.request_id == "r"
    raw = bytearray(batch_mod.encode(message, 7, 16))
    raw[blocks_at + 16 : blocks_at + 24] = (5).to_bytes(8, "little")  # the second run differs
    assert batch_mod.decode(bytes(raw), 16).block_ids == [[4, 9], [5, 9]]
