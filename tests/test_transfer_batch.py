"""Batches (wire version 7, shm version 6): several chunks of one request in one message,
with the same guarantees as chunks one by one: token checked, every byte checksummed, a
bad batch sent once more and then a clean failure, malformed or forged batches refused
without touching a live transfer."""

from __future__ import annotations

import asyncio
import random
import secrets

import pytest

from common.transfer import (
    TransferError,
    TransferState,
    batch,
    make_receiver,
    make_sender,
    shm_sender,
    wire,
)
from common.transfer import shm as shm_wire
from common.transfer.base import KVSender

TOKEN = secrets.token_bytes(16)


def layers_for(count: int, size: int, seed: int = 1):
    rng = random.Random(seed)
    return [(layer, [layer + 7, 3 * layer + 1], rng.randbytes(size + layer)) for layer in
            range(count)]


@pytest.fixture(params=["tcp", "shm"])
def kind(request) -> str:
    return request.param


@pytest.fixture
async def pair(kind):
    got: list = []
    rx = make_receiver(kind, sink=lambda r, layer, b, p: got.append((r, layer, b, bytes(p))))
    await rx.start()
    tx = make_sender(kind)
    batches: list[int] = []
    real = rx.table.on_batch

    def counting(message, *rest):
        batches.append(len(message.layers))
        return real(message, *rest)

    rx.table.on_batch = counting
    yield rx, tx, got, batches
    await tx.close()
    assert rx.live() == 0, "a test left a transfer live"
    await rx.close()


async def test_a_requests_layers_go_as_one_batch_and_arrive_in_order(pair):
    rx, tx, got, batches = pair
    transfer = rx.expect("r", lease_s=10, token=TOKEN)
    chunks = layers_for(30, 1000)
    await tx.send_many(rx.address, "r", chunks, token=TOKEN)
    await tx.finish(rx.address, "r", 30, token=TOKEN)
    await transfer.wait()
    assert got == [("r", layer, blocks, data) for layer, blocks, data in chunks]
    assert batches == [30]  # one message, one verdict
    assert transfer.chunks_received == 30
    assert transfer.bytes_received == sum(len(c[2]) for c in chunks)


async def test_batches_hold_at_most_max_bytes_and_a_large_chunk_goes_alone(pair):
    rx, tx, got, batches = pair
    transfer = rx.expect("big", lease_s=20, token=TOKEN)
    mib = 1 << 20
    sizes = [mib] * 9 + [5 * mib, 1000]
    chunks = [(i, [i], random.Random(i).randbytes(n)) for i, n in enumerate(sizes)]
    await tx.send_many(rx.address, "big", chunks, token=TOKEN)
    await tx.finish(rx.address, "big", len(chunks), token=TOKEN)
    await transfer.wait()
    if tx.BATCH_BYTES == batch.MAX_BYTES:  # shm
        assert batches == [4, 4]  # 4 + 4 MiB; then 1 MiB alone, 5 MiB alone, 1000 B alone
    else:  # tcp: batches of what one sendmsg takes corked, hashed just before they go
        assert tx.BATCH_BYTES == 2 << 20
        assert batches == [2, 2, 2, 2]  # then 1 MiB, 5 MiB and 1000 B alone
    assert [c[3] for c in got] == [c[2] for c in chunks]
    assert transfer.chunks_received == 11


async def test_shm_batch_staged_wrong_once_is_resent_and_then_exact(monkeypatch):
    got = []
    rx = make_receiver("shm", sink=lambda r, layer, b, p: got.append((layer, bytes(p))))
    await rx.start()
    tx = make_sender("shm")
    chunks = layers_for(5, 3000, seed=2)
    real_stage, flipped = shm_sender.stage_many, []

    def stage_many(destination, sources) -> int:  # one bit flipped in the segment, once
        value = real_stage(destination, sources)
        if not flipped:
            flipped.append(True)
            destination[sum(s.nbytes for s in sources[:2]) + 17] ^= 0x08  # in chunk 2
        return value

    monkeypatch.setattr(shm_sender, "stage_many", stage_many)
    try:
        transfer = rx.expect("flaky", lease_s=10, token=TOKEN)
        await tx.send_many(rx.address, "flaky", chunks, token=TOKEN)
        await tx.finish(rx.address, "flaky", 5, token=TOKEN)
        await transfer.wait()
        assert flipped == [True] and (tx.resent, rx.retried) == (1, 1)
        assert got == [(c[0], c[2]) for c in chunks]  # each chunk once, byte-exact
        assert transfer.chunks_received == 5
    finally:
        await tx.close()
        await rx.close()


async def test_tcp_batch_corrupted_in_flight_is_asked_for_again_then_exact():
    got = []
    rx = make_receiver("tcp", sink=lambda r, layer, b, p: got.append((layer, bytes(p))))
    await rx.start()
    try:
        transfer = rx.expect("flaky", lease_s=10, token=TOKEN)
        chunks = layers_for(3, 1000, seed=5)
        good = batch_message("flaky", chunks)
        bad = bytearray(good)
        bad[-500] ^= 0x10  # in the last chunk's bytes
        reader, writer = await raw_tcp(rx.address)
        writer.write(bytes(bad))
        verdict = await read_verdict(reader)
        assert verdict.status is wire.Status.RESEND
        assert verdict.reason.startswith("checksum mismatch on layers 0..2 (3 chunks)")
        assert got == [] and rx.retried == 1 and transfer.state is TransferState.PENDING
        writer.write(wire.encode(wire.Finish("flaky", 3, token=TOKEN)))  # before the resend
        writer.write(batch_message("flaky", chunks, attempt=1))
        await transfer.wait()
        assert await read_verdict(reader) == wire.OK
        assert got == [(c[0], c[2]) for c in chunks] and transfer.chunks_received == 3
        writer.close()
    finally:
        await rx.close()


async def test_a_batch_corrupted_twice_fails_cleanly_and_nothing_reached_the_sink(
    pair, monkeypatch
):
    rx, tx, got, batches = pair
    bad = rx.expect("bad", lease_s=10, token=TOKEN)
    chunks = layers_for(4, 2000, seed=3)
    real_checksum, real_stage = batch.checksum, shm_sender.stage_many
    # Every claim one bit off: the payload never matches what the sender says it is.
    monkeypatch.setattr(batch, "checksum", lambda views: real_checksum(views) ^ 1)
    monkeypatch.setattr(shm_sender, "stage_many", lambda d, s: real_stage(d, s) ^ 1)
    await tx.send_many(rx.address, "bad", chunks, token=TOKEN)
    mismatch = r"checksum mismatch on layers 0\.\.3 \(4 chunks\)"
    with pytest.raises(TransferError, match=mismatch) as e:
        await tx.finish(rx.address, "bad", 4, token=TOKEN)
    assert e.value.reason.endswith("(attempt 2 of 2)")
    with pytest.raises(TransferError, match="checksum mismatch"):
        await bad.wait()
    assert got == [] and bad.chunks_received == 0 and batches == [4, 4]
    assert (tx.resent, rx.retried) == (1, 1)
    monkeypatch.undo()
    good = rx.expect("good", lease_s=10, token=TOKEN)  # the connection keeps serving
    await tx.send_many(rx.address, "good", chunks, token=TOKEN)
    await tx.finish(rx.address, "good", 4, token=TOKEN)
    await good.wait()
    assert [c[3] for c in got] == [c[2] for c in chunks]


async def test_a_sink_that_raises_mid_batch_fails_the_transfer_with_its_reason(kind):
    seen = []

    def sink(rid, layer, blocks, payload):
        if layer == 2:
            raise RuntimeError("destination blocks were freed")
        seen.append(layer)

    rx = make_receiver(kind, sink=sink)
    await rx.start()
    tx = make_sender(kind)
    try:
        transfer = rx.expect("r", lease_s=10, token=TOKEN)
        await tx.send_many(rx.address, "r", layers_for(4, 500), token=TOKEN)
        with pytest.raises(TransferError, match="sink raised RuntimeError: destination"):
            await tx.finish(rx.address, "r", 4, token=TOKEN)
        assert transfer.state is TransferState.FAILED and seen == [0, 1]
        assert transfer.chunks_received == 2
    finally:
        await tx.close()
        await rx.close()


async def raw_tcp(address: str):
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    return await asyncio.open_connection(host, int(port))


async def read_verdict(reader) -> wire.Verdict:
    kind, header_len, _ = wire.decode_prefix(await reader.readexactly(wire.PREFIX.size))
    return wire.decode_header(kind, await reader.readexactly(header_len))


def batch_message(rid, chunks, token=TOKEN, attempt=0, payload_len=None):
    message = batch.Batch(rid, [c[0] for c in chunks], [c[1] for c in chunks], 0,
                          [len(c[2]) for c in chunks], attempt, token)
    payload = b"".join(c[2] for c in chunks)
    head = batch.encode(message, wire.checksum(payload), len(payload))
    size = len(payload) if payload_len is None else payload_len
    return (wire.PREFIX.pack(wire.MAGIC, wire.VERSION, wire.Kind.BATCH, 0, len(head), size)
            + head + payload + bytes(max(0, size - len(payload))))


async def test_forged_and_malformed_batches_are_refused_and_leave_the_transfer_alone():
    got = []
    rx = make_receiver("tcp", sink=lambda r, layer, b, p: got.append((layer, bytes(p))))
    await rx.start()
    try:
        transfer = rx.expect("victim", lease_s=10, token=TOKEN)
        chunks = layers_for(3, 100)
        reader, writer = await raw_tcp(rx.address)
        # The wrong token: dropped, counted, nothing written.
        writer.write(batch_message("victim", chunks, token=b"guess"))
        writer.write(wire.encode(wire.Finish("ghost", 0, token=TOKEN)))  # flushes verdicts
        assert await read_verdict(reader) == wire.DROPPED
        # The right token, but sizes that do not add up to the payload: refused too.
        writer.write(batch_message("victim", chunks, payload_len=400))
        verdict = await read_verdict(reader)
        assert verdict.status is wire.Status.FAILED
        assert "BATCH chunks of 303 bytes in a 400-byte payload" in verdict.reason
        assert rx.refused == 2 and got == []
        assert transfer.state is TransferState.PENDING and transfer.chunks_received == 0
        # The real one still goes through, on the same connection.
        writer.write(batch_message("victim", chunks))
        writer.write(wire.encode(wire.Finish("victim", 3, token=TOKEN)))
        await transfer.wait()
        assert await read_verdict(reader) == wire.OK
        assert got == [(c[0], c[2]) for c in chunks]
        writer.close()
    finally:
        await rx.close()


def test_batch_header_round_trips_and_rejects_what_breaks_the_spec():
    chunks = layers_for(3, 10)
    message = batch.Batch("r", [0, 1, 2], [c[1] for c in chunks], 0, [10, 11, 12], 1, TOKEN)
    head = batch.encode(message, 5, 33)
    assert batch.decode(head, 33) == message._replace(checksum=5)
    views = [memoryview(c[2]) for c in chunks]  # the checksum of the bytes back to back
    assert batch.checksum(views) == wire.checksum(b"".join(c[2] for c in chunks))
    for raw, size, error in (
        (head[:-1], 33, "its lengths say"),
        (head, 34, "BATCH chunks of 33 bytes in a 34-byte payload"),
        (head[:3], 33, "shorter than its fixed"),
        (bytes([2]) + head[1:], 33, "attempt must be in"),
        (head[:4] + bytes(4) + head[8:], 33, "BATCH of 0 chunks"),
    ):
        with pytest.raises(wire.WireError, match=error):
            batch.decode(raw, size)
    frame = shm_wire.chunk_frame(message._replace(attempt=0), 3, 1, 8192, 33, 5)
    placed = shm_wire.read_chunk(frame[4:])
    assert (placed.slot, placed.offset, placed.length, placed.chunk.layers) == (3, 8192, 33,
                                                                                [0, 1, 2])
    with pytest.raises(shm_wire.control.ControlError, match="payload") as info:
        shm_wire.read_chunk(frame[4:20] + (34).to_bytes(8, "little") + frame[28:])
    assert info.value.request_id == "r"


async def test_backends_without_batches_send_one_by_one():
    calls = []

    class OneByOne(KVSender):
        async def send(self, address, request_id, layer, block_ids, payload, *, token):
            calls.append((request_id, layer, block_ids, bytes(payload)))

        async def finish(self, *a, **k): ...
        async def abort(self, *a, **k): ...
        async def close(self): ...

    chunks = layers_for(3, 5)
    await OneByOne().send_many("x://h:1", "r", chunks, token=TOKEN)
    assert calls == [("r", c[0], c[1], c[2]) for c in chunks]


def test_a_requests_layers_sharing_one_block_list_are_checked_as_one_and_alike():
    from common.transfer.connections import _items

    blocks, data = [4, 9, 2], [bytes([i]) * (10 + i) for i in range(4)]
    shared = [(i, blocks, d) for i, d in enumerate(data)]  # the fast path
    apart = [(i, list(blocks), d) for i, d in enumerate(data)]  # one by one
    for checked in (_items(shared), _items(apart)):
        assert [(layer, runs, bytes(view)) for layer, runs, view in checked] == \
            [(i, blocks, d) for i, d in enumerate(data)]
        assert all(type(view) is memoryview and view.format == "B" for _, _, view in checked)
    view = memoryview(bytearray(8)).cast("I")  # not bytes: made flat, as send would
    assert _items([(0, blocks, view)])[0][2].nbytes == 8
    for bad, error in (((True, blocks, b"x"), "layer must be"),
                       ((-1, blocks, b"x"), "layer must be"),
                       ((0, [1, -2], b"x"), "block_ids must be"),
                       ((0, [1, True], b"x"), "block_ids must be")):
        with pytest.raises(wire.WireError, match=error):
            _items([(1, blocks, b"y"), bad])
    with pytest.raises(TypeError, match="bytes-like"):
        _items([(0, blocks, 5), (1, blocks, b"y")])


def test_a_requests_layers_come_back_as_one_run_of_columns_and_flat_bytes():
    from common.transfer.batch import MAX_CHUNKS, Run
    from common.transfer.connections import _items

    blocks = [7, 3]
    words = memoryview(bytearray(range(16))).cast("I")  # not bytes: made flat
    run = _items([(0, blocks, b"ab"), (5, blocks, words), (2, blocks, bytearray(b"xyz"))])
    assert type(run) is Run
    assert (run.layers, run.blocks, run.sizes) == ([0, 5, 2], [7, 3], [2, 16, 3])
    assert [bytes(v) for v in run.views] == [b"ab", bytes(range(16)), b"xyz"]
    assert all(v.format == "B" and v.ndim == 1 for v in run.views)
    assert list(run) == [(0, [7, 3], run.views[0]), (5, [7, 3], run.views[1]),
                         (2, [7, 3], run.views[2])]
    # Equal block lists that are not one list are one run all the same; other blocks in
    # one chunk, or a chunk of two fields, are checked chunk by chunk.
    same = _items([(0, [7, 3], b"ab"), (1, [7, 3], b"cd"), (2, list(blocks), b"ef")])
    assert type(same) is Run and same.blocks == [7, 3] and same.layers == [0, 1, 2]
    other = _items([(0, [7, 3], b"ab"), (1, [7, 4], b"cd")])
    assert [(layer, runs) for layer, runs, _ in other] == [(0, [7, 3]), (1, [7, 4])]
    with pytest.raises(ValueError, match="each chunk must be"):
        _items([(0, blocks, b"ab"), (1, blocks)])
    # More chunks than one batch holds: the chunks one by one, for batch.groups.
    many = _items([(i, blocks, b"z") for i in range(MAX_CHUNKS + 1)])
    assert type(many) is list and len(many) == MAX_CHUNKS + 1
    assert many[-1][0] == MAX_CHUNKS and many[-1][1] == [7, 3]


def test_batch_header_of_shared_and_differing_block_lists():
    shared = [5, 9, 2]
    message = batch.Batch("r", [0, 1, 2, 3], [shared] * 4, 0, [8, 8, 8, 8], 0, TOKEN)
    head = batch.encode(message, 7, 32)
    # Laid out as separate lists would be: the same bytes, one run per chunk.
    assert head == batch.encode(message._replace(block_ids=[list(shared) for _ in range(4)]),
                                7, 32)
    assert head.endswith(wire._blocks_struct(3).pack(*shared) * 4)
    decoded = batch.decode(memoryview(head), 32)  # as the tcp reader hands it
    assert decoded == message._replace(checksum=7)
    decoded.block_ids[0].append(99)  # each chunk's list is its own
    assert decoded.block_ids[1:] == [shared] * 3
    # The same counts but other blocks in one chunk: read run by run.
    runs = [[5, 9, 2], [5, 9, 2], [5, 9, 3], [5, 9, 2]]
    other = batch.decode(batch.encode(message._replace(block_ids=runs), 7, 32), 32)
    assert other.block_ids == runs
    # Fields out of range are the spec's error, not a crash.
    for bad in (message._replace(layers=[0, -1, 2, 3]), message._replace(sizes=[8, 8, 8, 8.0]),
                message._replace(block_ids=[shared] * 3)):
        with pytest.raises(wire.WireError):
            batch.encode(bad, 7, 32)
