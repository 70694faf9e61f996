"""The shm receiver's fused pass (common/transfer/base.py's LandingSink, kernels/
cpu_copysum.py's scatter_all): a chunk is copied out of the segment into the sink's
destination and hashed in the same pass; the digest is XXH3-64 of what landed; a chunk
whose digest does not match is asked for again or fails the transfer, and is never
``landed``, so nothing may take its bytes for KV."""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import types

import pytest
import xxhash

from common.transfer import TransferError, TransferState, make_receiver, make_sender, shm_sender
from common.transfer.batch import Batch
from common.transfer.table import TransferTable
from common.transfer.wire import Status
from kernels import cpu_copysum

pytestmark = pytest.mark.timeout(300)  # a cold extension cache builds the kernel first
TOKEN = secrets.token_bytes(16)


@pytest.fixture(scope="module")
def mod():
    pytest.importorskip("torch")
    built = cpu_copysum._KERNEL.module()
    if built is None:
        pytest.skip("no C++ compiler: the shm receiver hashes the segment, the sink copies")
    return built


def pieces(sizes: list[int]) -> list[memoryview]:
    return [memoryview(bytearray(b"\x07" * n)) for n in sizes]


@pytest.mark.parametrize("sizes", [
    [241], [256], [1025], [64, 64, 64, 64], [100, 141], [1, 2000, 3], [0, 5000, 0, 77],
    [63, 65, 127, 129, 1000], [12288] * 8, [3000, 1, 1, 61], [4 << 20, 1],
])
def test_scatter_lands_the_bytes_and_returns_xxh3_of_them(mod, sizes):
    source = os.urandom(sum(sizes))
    destinations = pieces(sizes)
    digest = cpu_copysum.scatter_sum(mod, memoryview(source), destinations)
    assert digest == xxhash.xxh3_64_intdigest(source)
    assert b"".join(bytes(d) for d in destinations) == source


def test_random_scatters_match_xxh3(mod):
    rng = random.Random(11)
    for _ in range(200):
        sizes = [rng.choice([0, rng.randint(1, 200), 64 * rng.randint(1, 40)])
                 for _ in range(rng.randint(0, 6))] + [241 + rng.randint(0, 3000)]
        rng.shuffle(sizes)
        source = rng.randbytes(sum(sizes))
        destinations = pieces(sizes)
        assert mod.scatter_all(source, destinations) == xxhash.xxh3_64_intdigest(source), sizes
        assert b"".join(bytes(d) for d in destinations) == source


def test_lengths_that_do_not_add_up_copy_nothing(mod):
    destinations = pieces([600, 600])
    with pytest.raises(ValueError, match="source of 1000 bytes for destinations of 1200"):
        mod.scatter_all(b"\x01" * 1000, destinations)
    with pytest.raises(ValueError, match="more than 240"):
        mod.scatter_all(b"\x01" * 200, pieces([200]))
    with pytest.raises(BufferError):  # a read-only destination
        mod.scatter_all(b"\x01" * 300, [memoryview(b"\x00" * 300)])
    assert all(bytes(d) == b"\x07" * 600 for d in destinations)


def spoil_staging(monkeypatch, spoiled, at: int, mask: int) -> None:
    """The shm sender stages the right digest, then flips ``mask`` in byte ``at`` of the
    segment where ``spoiled(number of batches staged before)`` says so."""
    staged, real = [], shm_sender.stage_many

    def stage_many(destination, sources):
        digest = real(destination, sources)
        if spoiled(len(staged)):
            destination[at] ^= mask
        staged.append(digest)
        return digest

    monkeypatch.setattr(shm_sender, "stage_many", stage_many)


@contextlib.asynccontextmanager
async def shm_pair(sink):
    """A started shm receiver landing in ``sink`` and a sender, both closed after."""
    rx = make_receiver("shm", sink=sink)
    await rx.start()
    tx = make_sender("shm")
    try:
        yield rx, tx
    finally:
        await tx.close()
        await rx.close()


async def send_each(rx, tx, rids, chunks, before=lambda rid: None) -> dict:
    """Each request's chunks sent and finished in turn (``before(rid)`` first); only
    "bad" may fail, on a checksum mismatch. The transfers, by request id."""
    transfers = {}
    for rid in rids:
        before(rid)
        transfers[rid] = rx.expect(rid, lease_s=30, token=TOKEN)
        try:
            await tx.send_many(rx.address, rid, chunks, token=TOKEN)
            await tx.finish(rx.address, rid, len(chunks), token=TOKEN)
        except TransferError as exc:
            assert rid == "bad" and "checksum mismatch" in exc.reason
    return transfers


class Sink:
    """A LandingSink over one destination per request: each chunk's bytes go at its
    offset in two pieces (cut off the 64-byte stripes), as a worker's blocks lie apart."""

    def __init__(self, chunks: list, rids: list[str]) -> None:
        self.offsets, at = {}, 0
        for layer, _, payload in chunks:
            self.offsets[layer] = at
            at += len(payload)
        self.kv = {rid: bytearray(at) for rid in rids}
        self.landed_chunks: dict[str, list[int]] = {rid: [] for rid in rids}
        self.called: list[str] = []

    def __call__(self, rid, layer, block_ids, payload) -> None:
        self.called.append(rid)

    def landing(self, rid, layer, block_ids, nbytes):
        at, view = self.offsets[layer], memoryview(self.kv[rid])
        return [view[at : at + 1000], view[at + 1000 : at + nbytes]]

    def landed(self, rid, layer, block_ids, nbytes) -> None:
        self.landed_chunks[rid].append(layer)


async def test_a_corrupted_shm_message_is_refused_by_the_fused_pass(mod, monkeypatch):
    chunks = [(layer, [1, 2], os.urandom(24576 + layer)) for layer in range(30)]
    whole = b"".join(c[2] for c in chunks)
    rids = ["clean", "resent", "bad"]
    sink = Sink(chunks, rids)
    scattered = []

    def scatter_all(source, destinations):
        scattered.append(len(destinations))
        return mod.scatter_all(source, destinations)

    monkeypatch.setattr(cpu_copysum, "kernel", lambda wait=False: types.SimpleNamespace(
        copy_all=mod.copy_all, scatter_all=scatter_all))
    # "resent" spoiled once, "bad" on both attempts.
    spoil_staging(monkeypatch, lambda staged: staged in (1, 3, 4), 5000, 0x40)
    async with shm_pair(sink) as (rx, tx):
        transfers = await send_each(rx, tx, rids, chunks)
        for rid in ("clean", "resent"):
            await transfers[rid].wait()
            assert transfers[rid].chunks_received == 30
            assert sink.landed_chunks[rid] == list(range(30))
            assert sink.kv[rid] == whole
        with pytest.raises(TransferError, match=r"checksum mismatch .*\(attempt 2 of 2\)"):
            await transfers["bad"].wait()
        bad = transfers["bad"]
        assert (bad.state, bad.chunks_received, bad.bytes_received) == (TransferState.FAILED, 0, 0)
        assert sink.landed_chunks["bad"] == []  # its blocks never marked as holding KV
        assert sink.called == []  # every batch went through the fused pass
        assert scattered == [60] * 5 and rx.retried == 2 and tx.resent == 2


class RaisingSink(Sink):
    def __init__(self, answer) -> None:
        super().__init__([(0, [1], b"\x00" * 5000)], ["r"])
        self.answer = answer

    def landing(self, rid, layer, block_ids, nbytes):
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


@pytest.mark.parametrize("answer, error", [
    (RuntimeError("no room"), "sink raised RuntimeError: no room"),
    ([memoryview(bytearray(4000))], "sink raised ValueError: scatter: a source of 5000"),
])
async def test_a_landing_that_raises_or_does_not_fit_fails_the_transfer(mod, answer, error):
    sink = RaisingSink(answer)
    table = TransferTable(sink)
    transfer = table.expect("r", 30, TOKEN)
    payload = memoryview(os.urandom(5000))
    batch = Batch("r", [0], [[1]], xxhash.xxh3_64_intdigest(payload), [5000], 0, TOKEN)
    verdict = table.on_batch(batch, payload, scatter=mod.scatter_all)
    assert verdict.status is Status.FAILED and verdict.reason.startswith(error)
    assert transfer.state is TransferState.FAILED and sink.landed_chunks["r"] == []


async def test_a_sink_that_declines_takes_the_chunk_through_its_call(mod):
    sink = RaisingSink(None)
    table = TransferTable(sink)
    transfer = table.expect("r", 30, TOKEN)
    payload = memoryview(os.urandom(5000))
    batch = Batch("r", [0], [[1]], xxhash.xxh3_64_intdigest(payload), [5000], 0, TOKEN)
    assert table.on_batch(batch, payload, scatter=mod.scatter_all).status is Status.OK
    table.on_finish("r", 1, TOKEN)
    assert sink.called == ["r"] and sink.landed_chunks["r"] == []
    assert transfer.state is TransferState.DONE and transfer.bytes_received == 5000


class ManySink(Sink):
    """A sink with the batch forms: one call each a batch, never the per-chunk ones."""

    def __init__(self, chunks: list, rids: list[str]) -> None:
        super().__init__(chunks, rids)
        self.calls: list[tuple[str, str, list[int]]] = []

    def landing(self, rid, layer, block_ids, nbytes):
        raise AssertionError("the per-chunk form is not called when the batch form is there")

    def landing_many(self, rid, layers, block_ids, sizes):
        self.calls.append(("landing", rid, list(layers)))
        return [v for layer, size in zip(layers, sizes, strict=True)
                for v in Sink.landing(self, rid, layer, None, size)]

    def landed_many(self, rid, layers, block_ids, sizes):
        self.calls.append(("landed", rid, list(layers)))
        self.landed_chunks[rid].extend(layers)


async def test_a_sink_with_batch_forms_is_asked_once_a_batch(mod, monkeypatch):
    chunks = [(layer, [1, 2], os.urandom(20000 + 3 * layer)) for layer in range(30)]
    sink = ManySink(chunks, ["ok", "bad"])
    sending = []
    spoil_staging(monkeypatch, lambda staged: "bad" in sending, 7, 1)  # on both attempts
    async with shm_pair(sink) as (rx, tx):
        transfers = await send_each(rx, tx, ("ok", "bad"), chunks, before=sending.append)
        await transfers["ok"].wait()
    layers = list(range(30))
    assert sink.calls == [("landing", "ok", layers), ("landed", "ok", layers),
                          ("landing", "bad", layers), ("landing", "bad", layers)]
    assert sink.kv["ok"] == b"".join(c[2] for c in chunks)
    assert sink.landed_chunks == {"ok": layers, "bad": []} and sink.called == []
    assert transfers["bad"].state is TransferState.FAILED
    assert transfers["ok"].chunks_received == 30
