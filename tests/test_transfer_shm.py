"""The shm backend's control channel: a request of small chunks costs one notice write,
and the binary chunk frame (shm version 3) refuses what does not follow its layout
without touching a live transfer."""

from __future__ import annotations

import asyncio
import random
import secrets
import time

import pytest

from common.address import dial_target
from common.transfer import TransferError, TransferState, control, make_receiver, wire
from common.transfer.shm import CHUNK_PLACE, VERSION, chunk_frame, read_chunk
from common.transfer.shm_segment import new_prefix
from common.transfer.shm_sender import ShmSender
from tests.kv_sink import Sink

pytestmark = pytest.mark.timeout(60)
TOKEN = secrets.token_bytes(16)



@pytest.fixture
async def receiver():
    sink = Sink()
    rx = make_receiver("shm", sink=sink)
    await rx.start()
    rx.sink = sink
    yield rx
    await rx.close()


async def until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)


def test_chunk_frame_round_trips():
    chunk = wire.Chunk("req-7", 29, [3, 1 << 40], 0xDEADBEEF, 1, b"t" * 16)
    frame = chunk_frame(chunk, 63, 70000, 1 << 33, 49152)
    body = frame[control.LENGTH.size :]
    assert control.LENGTH.unpack_from(frame)[0] == len(body)
    assert body[0] == control.BINARY
    assert read_chunk(body) == (chunk, 63, 70000, 1 << 33, 49152)
    parser = control.FrameParser()
    assert parser.feed(frame[:10]) == [] and parser.feed(frame[10:]) == [body]


@pytest.mark.parametrize(
    ("body", "match", "rid"),
    [
        (bytes([control.BINARY]) + bytes(10), "shorter than its fixed", None),
        (CHUNK_PLACE.pack(control.BINARY, 64, 0, 1, 0, 10)
         + wire.encode_chunk(wire.Chunk("r", 0, [1], 5, token=b"x")), "slot 64", "r"),
        (CHUNK_PLACE.pack(control.BINARY, 0, 0, 1, 0, 10)
         + wire.encode_chunk(wire.Chunk("r", 0, [1], 5, token=b"x"))[:-3], "lengths say", None),
    ],
)
def test_malformed_chunk_frames_are_refused(body, match, rid):
    with pytest.raises(control.ControlError, match=match) as caught:
        read_chunk(body)
    assert caught.value.request_id == rid


async def test_a_request_of_small_chunks_is_one_batch_frame_then_the_finish(receiver):
    tx = ShmSender()
    plan = [("r", layer, [layer, 40 + layer], random.Random(layer).randbytes(48 << 10))
            for layer in range(30)]  # 1.4 MiB: a few hundred tokens of KV, a layer each
    try:
        warm = receiver.expect("warm", lease_s=5, token=TOKEN)
        await tx.send(receiver.address, "warm", 0, [0], b"w", token=TOKEN)
        await tx.finish(receiver.address, "warm", 1, token=TOKEN)
        await warm.wait()
        conn = tx._conns[receiver.address]
        writes, write = [], conn.transport.write
        conn.transport.write = lambda data: (writes.append(len(data)), write(data))
        transfer = receiver.expect("r", lease_s=5, token=TOKEN)
        for rid, layer, blocks, payload in plan:
            await tx.send(receiver.address, rid, layer, blocks, payload, token=TOKEN)
        await tx.finish(receiver.address, "r", len(plan), token=TOKEN)
        await transfer.wait()
        assert [c for c in receiver.sink.chunks if c[0] == "r"] == plan
        # The 30 chunks went as one BATCH, its frame written at once (the receiver copies
        # while the finish is built); then the finish.
        finish = control.pack("finish", request_id="r", num_chunks=len(plan), token=TOKEN)
        assert len(writes) == 2 and writes[1] == len(finish), writes
        assert writes[0] < 2048, writes  # one BATCH frame (1.3 KB), not 30 (2.7 KB)
    finally:
        await tx.close()


async def test_a_malformed_chunk_frame_closes_only_its_connection(receiver):
    transfer = receiver.expect("r", lease_s=5, token=TOKEN)
    host, port = dial_target(receiver.address, "shm")
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(control.pack("hello", v=VERSION, prefix=new_prefix()))
    # Its request id reads, its slot is out of range: refused, the transfer untouched.
    bad = CHUNK_PLACE.pack(control.BINARY, 200, 0, 1, 0, 10) + wire.encode_chunk(
        wire.Chunk("r", 0, [1], 5, token=TOKEN))
    writer.write(control.LENGTH.pack(len(bad)) + bad)
    await writer.drain()
    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the receiver
    writer.close()
    assert transfer.state is TransferState.PENDING and receiver.refused == 1
    # The real sender still completes it.
    tx = ShmSender()
    try:
        await tx.send(receiver.address, "r", 0, [1], b"kv" * 100, token=TOKEN)
        await tx.finish(receiver.address, "r", 1, token=TOKEN)
        await transfer.wait()
    finally:
        await tx.close()
    assert receiver.sink.chunks == [("r", 0, [1], b"kv" * 100)]


async def test_a_chunk_frame_before_hello_is_refused(receiver):
    host, port = dial_target(receiver.address, "shm")
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(chunk_frame(wire.Chunk("r", 0, [1], 5, token=TOKEN), 0, 1, 0, 10))
    await writer.drain()
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()
    await until(lambda: receiver.connections == 0)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [("layer", True, "layer must be"), ("layer", -1, "layer must be"),
     ("layer", 1 << 64, "layer must be"), ("block_ids", [1, -2], "block_ids must be"),
     ("block_ids", (1, 2), "block_ids must be"), ("block_ids", [1.0], "block_ids must be"),
     ("token", "x", "token must be"), ("token", b"t" * 65, "token must be"),
     ("request_id", "", "request_id must be"), ("attempt", 2, "attempt must be"),
     ("checksum", 1 << 64, "checksum must be")],
)
def test_chunk_validation_refuses_each_bad_field(field, value, match):
    good = wire.Chunk("r", 3, [1, 4], 0, 0, TOKEN)
    wire.validate(good)
    wire.validate(good._replace(block_ids=[], layer=(1 << 64) - 1))
    with pytest.raises(wire.WireError, match=match):
        wire.validate(good._replace(**{field: value}))


async def test_a_binary_record_from_the_receiver_side_fails_the_sender_cleanly():
    # A "receiver" that answers with a binary record instead of verdicts: the sender's
    # send or finish raises TransferError naming the protocol error; nothing leaks.
    async def rogue(reader, writer):
        await reader.read(1 << 16)
        body = bytes([control.BINARY]) + bytes(30)
        writer.write(control.LENGTH.pack(len(body)) + body)
        await writer.drain()
        await reader.read()  # until the sender drops the connection
        writer.close()

    server = await asyncio.start_server(rogue, "127.0.0.1", 0)
    address = f"shm://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    tx = ShmSender()
    try:
        with pytest.raises(TransferError, match="protocol error: unexpected binary record"):
            await tx.send(address, "r", 0, [1], b"x" * 100, token=TOKEN)
            await tx.finish(address, "r", 1, token=TOKEN)
    finally:
        await tx.close()
        server.close()
    assert tx.connections == 0
