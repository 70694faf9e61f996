"""The tcp receiver lands a BATCH where its sink names (common/transfer/frame_reader.py,
``LandingSink.landing_many``): large destinations are read into straight from the
socket and hashed as the bytes land, small ones get the staged payload in one
copy-and-hash pass; either way the sink hears ``landed_many`` only for a batch whose
digest matched, a corrupted one is asked for again into the same place, and a sink
that raises or names destinations that cannot hold the batch fails that transfer
alone."""

from __future__ import annotations

import os
import secrets

import pytest

from common.transfer import TransferError, TransferState, make_receiver, make_sender, wire
from common.transfer.frame_reader import FrameReader
from tests.test_transfer_batch import batch_message, raw_tcp, read_verdict

TOKEN = secrets.token_bytes(16)


class Sink:
    """Each chunk's bytes at its offset in one buffer per request, in ``pieces`` views
    per chunk (a decode worker names a view per run of blocks, K and V apart)."""

    def __init__(self, chunks: list, pieces: int = 1, answer=None) -> None:
        self.sizes = [len(c[2]) for c in chunks]
        self.pieces, self.answer = pieces, answer
        self.kv: dict[str, bytearray] = {}
        self.calls: list[tuple[str, str, list[int]]] = []
        self.called: list[int] = []

    def __call__(self, rid, layer, block_ids, payload) -> None:
        self.called.append(layer)

    def landing_many(self, rid, layers, block_ids, sizes):
        self.calls.append(("landing", rid, list(layers)))
        if self.answer is not None:
            if isinstance(self.answer, Exception):
                raise self.answer
            return self.answer
        kv = memoryview(self.kv.setdefault(rid, bytearray(sum(self.sizes))))
        out = []
        for layer, size in zip(layers, sizes, strict=True):
            at, step = sum(self.sizes[:layer]), -(-size // self.pieces)
            out += [kv[at + i : at + min(i + step, size)] for i in range(0, size, step)]
        return out

    def landed_many(self, rid, layers, block_ids, sizes) -> None:
        self.calls.append(("landed", rid, list(layers)))


def chunks_of(count: int, size: int) -> list:
    return [(layer, [2 * layer, 5], os.urandom(size + 64 * layer)) for layer in range(count)]


@pytest.mark.parametrize("count, size, pieces, staged", [
    (8, 300_000, 1, False),  # 2.4 MB batches of 300 KB views: read straight into them
    (30, 48 << 10, 4, True),  # 1.4 MB of 12 KiB views: staged, then one copy-and-hash
])
async def test_batches_land_where_the_sink_names(count, size, pieces, staged):
    if staged:
        pytest.importorskip("torch")
        from kernels import cpu_copysum
        if cpu_copysum.kernel(wait=True) is None:
            pytest.skip("no vectorized copy-and-checksum kernel here")
    chunks = chunks_of(count, size)
    sink = Sink(chunks, pieces)
    rx = make_receiver("tcp", sink=sink)
    await rx.start()
    tx = make_sender("tcp")
    try:
        for rid in ("a", "b", "c"):
            transfer = rx.expect(rid, lease_s=30, token=TOKEN)
            await tx.send_many(rx.address, rid, chunks, token=TOKEN)
            await tx.finish(rx.address, rid, count, token=TOKEN)
            await transfer.wait()
            assert transfer.chunks_received == count
            assert sink.kv[rid] == b"".join(c[2] for c in chunks)
        [reader] = [c for c in rx._connections if isinstance(c, FrameReader)]
        # Straight into the destinations: the reader never staged a payload.
        assert (len(reader._payload) > 0) is staged
    finally:
        await tx.close()
        await rx.close()
    assert sink.called == []  # every batch landed in place, none through the call
    landed = [c for c in sink.calls if c[0] == "landed"]
    assert sorted({c[1] for c in landed}) == ["a", "b", "c"]
    assert sorted(layer for c in landed for layer in c[2]) == sorted(list(range(count)) * 3)
    assert len(sink.calls) == 2 * len(landed)  # one landing_many per landed_many


async def test_a_corrupted_batch_read_in_place_is_never_landed_and_comes_again():
    chunks = chunks_of(4, 300_000)
    sink = Sink(chunks)
    rx = make_receiver("tcp", sink=sink)
    await rx.start()
    try:
        transfer = rx.expect("r", lease_s=30, token=TOKEN)
        good = batch_message("r", chunks, TOKEN)
        bad = bytearray(good)
        bad[-1000] ^= 0x20
        reader, writer = await raw_tcp(rx.address)
        writer.write(bytes(bad))
        verdict = await read_verdict(reader)
        assert verdict.status is wire.Status.RESEND and "checksum mismatch" in verdict.reason
        assert sink.calls == [("landing", "r", [0, 1, 2, 3])]  # in place, not landed
        assert transfer.state is TransferState.PENDING and transfer.chunks_received == 0
        writer.write(batch_message("r", chunks, TOKEN, attempt=1))
        writer.write(wire.encode(wire.Finish("r", 4, token=TOKEN)))
        assert await read_verdict(reader) == wire.OK
        await transfer.wait()
        assert sink.calls[1:] == [("landing", "r", [0, 1, 2, 3]), ("landed", "r", [0, 1, 2, 3])]
        assert sink.kv["r"] == b"".join(c[2] for c in chunks)
        writer.close()
    finally:
        await rx.close()


@pytest.mark.parametrize("answer, reason", [
    (RuntimeError("no room"), "sink raised RuntimeError: no room"),
    ([memoryview(bytearray(1_000_000))], "sink raised ValueError: destinations of "
                                         "1000000 bytes for a batch of 1200384"),
    ([memoryview(bytes(1_200_384))], "sink raised ValueError: a destination that is "
                                     "read-only"),
])
async def test_a_sink_that_cannot_take_the_batch_fails_its_transfer_alone(answer, reason):
    chunks = chunks_of(4, 300_000)
    sink = Sink(chunks, answer=answer)
    rx = make_receiver("tcp", sink=sink)
    await rx.start()
    tx = make_sender("tcp")
    try:
        transfer = rx.expect("bad", lease_s=30, token=TOKEN)
        await tx.send_many(rx.address, "bad", chunks, token=TOKEN)
        with pytest.raises(TransferError) as err:
            await tx.finish(rx.address, "bad", 4, token=TOKEN)
        assert err.value.reason.startswith(reason)
        assert transfer.state is TransferState.FAILED and transfer.error.startswith(reason)
        assert [c[0] for c in sink.calls] == ["landing"] and sink.called == []
        sink.answer = None  # the same connection serves the next transfer
        good = rx.expect("good", lease_s=30, token=TOKEN)
        await tx.send_many(rx.address, "good", chunks, token=TOKEN)
        await tx.finish(rx.address, "good", 4, token=TOKEN)
        await good.wait()
        assert sink.kv["good"] == b"".join(c[2] for c in chunks)
    finally:
        await tx.close()
        await rx.close()
