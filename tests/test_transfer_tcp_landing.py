"""The tcp receiver lands a BATCH where its sink names (common/transfer/frame_reader.py,
``LandingSink.landing_many``): large destinations are read into straight from the
socket and hashed as the bytes land, small ones get the staged payload in one
copy-and-hash pass; either way the sink hears ``landed_many`` only for a batch whose
digest matched, a corrupted one is asked for again into the same place, and a sink
that raises or names destinations that cannot hold the batch fails that transfer
alone."""

from __future__ import annotations

import asyncio
import os
import secrets

import pytest

from common.transfer import (
    TransferState,
    frame_reader,
    make_receiver,
    make_sender,
    wire,
)
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


@pytest.fixture
def fillings(monkeypatch) -> list[int]:
    """The destination counts of each batch read straight into a sink's destinations."""
    made = []

    class Counted(frame_reader.Filling):
        def __init__(self, destinations, nbytes) -> None:
            made.append(len(destinations))
            super().__init__(destinations, nbytes)

    monkeypatch.setattr(frame_reader, "Filling", Counted)
    return made


async def send_split(writer, message: bytes, payload_len: int) -> None:
    """The message's header and first 1000 payload bytes, then, once the receiver had
    them, the rest: a batch the reader must read the rest of, not one read ahead."""
    cut = len(message) - payload_len + 1000
    writer.write(message[:cut])
    await writer.drain()
    await asyncio.sleep(0.05)
    writer.write(message[cut:])


async def test_large_destinations_are_read_into_from_the_socket(fillings):
    chunks = chunks_of(8, 300_000)  # 2.4 MB batches of 300 KB views
    sink = Sink(chunks)
    rx = make_receiver("tcp", sink=sink)
    await rx.start()
    try:
        reader, writer = await raw_tcp(rx.address)
        for rid in ("a", "b"):
            transfer = rx.expect(rid, lease_s=30, token=TOKEN)
            await send_split(writer, batch_message(rid, chunks, TOKEN),
                             sum(len(c[2]) for c in chunks))
            writer.write(wire.encode(wire.Finish(rid, 8, token=TOKEN)))
            assert await read_verdict(reader) == wire.OK
            await transfer.wait()
            assert transfer.chunks_received == 8
            assert sink.kv[rid] == b"".join(c[2] for c in chunks)
        writer.close()
    finally:
        await rx.close()
    assert fillings == [8, 8] and sink.called == []
    layers = list(range(8))
    assert sink.calls == [(step, rid, layers) for rid in ("a", "b")
                          for step in ("landing", "landed")]


async def test_small_destinations_get_the_payload_in_one_copy_and_hash_pass(fillings):
    pytest.importorskip("torch")
    from kernels import cpu_copysum
    if cpu_copysum.kernel(wait=True) is None:
        pytest.skip("no vectorized copy-and-checksum kernel here")
    chunks = chunks_of(30, 48 << 10)  # 1.4 MB of 12 KiB views, as a decode worker's
    sink = Sink(chunks, pieces=4)
    rx = make_receiver("tcp", sink=sink)
    await rx.start()
    tx = make_sender("tcp")
    try:
        for rid in ("a", "b", "c"):
            transfer = rx.expect(rid, lease_s=30, token=TOKEN)
            await tx.send_many(rx.address, rid, chunks, token=TOKEN)
            await tx.finish(rx.address, rid, 30, token=TOKEN)
            await transfer.wait()
            assert transfer.chunks_received == 30
            assert sink.kv[rid] == b"".join(c[2] for c in chunks)
    finally:
        await tx.close()
        await rx.close()
    assert fillings == [] and sink.called == []  # copied in, never through the call
    assert sink.calls == [(step, rid, list(range(30))) for rid in ("a", "b", "c")
                          for step in ("landing", "landed")]


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
    whole = b"".join(c[2] for c in chunks)
    sink = Sink(chunks, answer=answer)
    rx = make_receiver("tcp", sink=sink)
    await rx.start()
    try:
        reader, writer = await raw_tcp(rx.address)
        transfer = rx.expect("bad", lease_s=30, token=TOKEN)
        await send_split(writer, batch_message("bad", chunks, TOKEN), len(whole))
        verdict = await read_verdict(reader)  # a failure is written at once
        assert verdict.status is wire.Status.FAILED and verdict.reason.startswith(reason)
        assert transfer.state is TransferState.FAILED and transfer.error.startswith(reason)
        assert [c[0] for c in sink.calls] == ["landing"] and sink.called == []
        sink.answer = None  # the same connection serves the next transfer
        good = rx.expect("good", lease_s=30, token=TOKEN)
        await send_split(writer, batch_message("good", chunks, TOKEN), len(whole))
        writer.write(wire.encode(wire.Finish("good", 4, token=TOKEN)))
        assert await read_verdict(reader) == wire.OK
        await good.wait()
        assert sink.kv["good"] == whole
        writer.close()
    finally:
        await rx.close()
