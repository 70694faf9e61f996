"""The decode worker's data-plane sink lands KV in the reserved blocks' own memory
(services/worker/kv_landing.py, services/worker/decode_sink.py): the views it names are
exactly those blocks' K and V, in payload order; it checks the request and its blocks as
the sink call does; and it declines every layout it cannot name (a device, tensor-
parallel or simulated store, a quantized dtype, strided tensors)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from common.sampling_params import SamplingParams
from common.transfer import TransferError
from services.engine.kv_cache import KVCache
from services.worker.decode_sink import DecodeSink
from services.worker.decode_state import Remote
from services.worker.engine_loop import EngineLoop
from services.worker.kv_landing import KVLanding
from services.worker.server import build_engine
from services.worker.settings import WorkerSettings
from tests.tiny_models import random_prompts

LAYERS, BLOCKS, SIZE, HEADS, DIM = 3, 10, 4, 2, 8


def write_through(views: list[memoryview], payload: bytes) -> None:
    at = 0
    for view in views:
        view[:] = payload[at : at + view.nbytes]
        at += view.nbytes
    assert at == len(payload)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_views_are_the_blocks_k_then_v(dtype):
    cache = KVCache(LAYERS, BLOCKS, SIZE, HEADS, DIM, dtype)
    ids = [6, 2, 3, 4, 9]  # out of order, with a run of three
    payload = torch.randn(2, len(ids), SIZE, HEADS, DIM).to(dtype)
    raw = payload.view(torch.uint8).numpy().tobytes()
    views = KVLanding.of(cache).views(1, ids, len(raw))
    block = SIZE * HEADS * DIM * payload.element_size()
    # One view per run: 6 | 2 3 4 | 9, for K and again for V.
    assert [v.nbytes for v in views] == [block, 3 * block, block] * 2
    write_through(views, raw)
    assert torch.equal(cache.k[1, ids], payload[0]) and torch.equal(cache.v[1, ids], payload[1])
    # Nothing else moved: other blocks of the layer, other layers.
    others = [b for b in range(BLOCKS) if b not in ids]
    assert not cache.k[1, others].any() and not cache.v[1, others].any()
    assert not cache.k[[0, 2]].any() and not cache.v[[0, 2]].any()
    # The same cache as the sink call's import makes.
    other = KVCache(LAYERS, BLOCKS, SIZE, HEADS, DIM, dtype)
    other.import_layer_bytes(1, ids, raw)
    assert torch.equal(other.k, cache.k) and torch.equal(other.v, cache.v)


def test_the_views_refuse_what_does_not_fit():
    landing = KVLanding.of(KVCache(LAYERS, BLOCKS, SIZE, HEADS, DIM, torch.float32))
    block = SIZE * HEADS * DIM * 4
    with pytest.raises(ValueError, match="layer 3 outside 0..2"):
        landing.views(3, [1], 2 * block)
    with pytest.raises(ValueError, match=r"block ids out of range 0..9"):
        landing.views(0, [1, 10], 4 * block)
    with pytest.raises(ValueError, match=f"KV payload of {2 * block - 4} bytes for 1 blocks"):
        landing.views(0, [1], 2 * block - 4)
    assert landing.views(0, [], 0) == []


def test_the_views_of_a_batch_are_each_layers_in_turn():
    cache = KVCache(LAYERS, BLOCKS, SIZE, HEADS, DIM, torch.float32)
    landing = KVLanding.of(cache)
    ids, block = [6, 2, 3, 9], SIZE * HEADS * DIM * 4
    size = 2 * block * len(ids)
    many = landing.views_many([2, 0, 1], ids, [size] * 3)
    one = [v for layer in (2, 0, 1) for v in landing.views(layer, ids, size)]
    assert [v.nbytes for v in many] == [v.nbytes for v in one] == [block, 2 * block, block] * 6
    raw = torch.randn(3, 2, len(ids), SIZE, HEADS, DIM)
    write_through(many, raw.view(torch.uint8).numpy().tobytes())
    for i, layer in enumerate((2, 0, 1)):
        assert torch.equal(cache.k[layer, ids], raw[i, 0])
        assert torch.equal(cache.v[layer, ids], raw[i, 1])
    # Any layer, block or size out of place refuses the whole batch, before any view.
    with pytest.raises(ValueError, match="layer 3 outside 0..2"):
        landing.views_many([0, 3], ids, [size] * 2)
    with pytest.raises(ValueError, match=r"block ids out of range 0..9"):
        landing.views_many([0, 1], [1, 10], [4 * block] * 2)
    with pytest.raises(ValueError, match=f"KV payload of {size - 4} bytes for 4 blocks"):
        landing.views_many([0, 1], ids, [size, size - 4])
    with pytest.raises(ValueError, match="2 layers, 1 sizes"):
        landing.views_many([0, 1], ids, [size])


def test_unusual_caches_are_declined():
    def cache(**kw):
        return KVCache(LAYERS, BLOCKS, SIZE, HEADS, DIM, kw.pop("dtype", torch.float32), **kw)
    assert KVLanding.of(cache()) is not None
    # kv_cache_dtype int8: each row carries its own scale, so a block is its bytes
    assert KVLanding.of(cache(dtype=torch.int8)) is not None
    assert KVLanding.of(cache(dtype=torch.float8_e4m3fn)) is None  # no such cache dtype
    assert KVLanding.of(cache(device="meta")) is None  # not host memory (as CUDA)
    strided = cache()
    strided.v = torch.zeros(LAYERS, BLOCKS, HEADS, SIZE, DIM).transpose(2, 3)
    assert KVLanding.of(strided) is None
    sim = build_engine(WorkerSettings(executor="sim", sim_time_scale=0))
    assert KVLanding.of(sim.kv_store) is None  # the simulated store
    assert KVLanding.of(object()) is None  # e.g. a tensor-parallel ShardedKVStore


class Bytes:
    def __init__(self) -> None:
        self.total = 0

    def inc(self, n: int) -> None:
        self.total += n


class Metrics:
    def __init__(self) -> None:
        self.kv_transfer_bytes = Bytes()


async def started(engine) -> EngineLoop:
    loop = EngineLoop(lambda outputs, step_s: None)
    await loop.start(lambda: engine)
    return loop


async def reserve(loop, engine, prompt):
    """Blocks reserved for request "r", its prefill done elsewhere: (the slots, the blocks
    its KV lands in, one layer's bytes of those blocks)."""
    slots = await loop.run(lambda e: e.reserve_remote_prefill(
        "r", prompt, SamplingParams(max_tokens=2)))
    want = slots.block_ids[slots.num_cached_blocks:]
    store = engine.kv_store
    return slots, want, store.block_nbytes // store.num_layers * len(want)


def layer_bytes(store, blocks: int) -> bytes:
    """Random K/V of one layer over ``blocks`` blocks, as a prefill worker sends it."""
    return torch.randn(2, blocks, *store.k.shape[2:]).view(torch.uint8).numpy().tobytes()


def test_the_decode_sink_lands_in_the_reserved_blocks_only(tiny_dirs, make_engine):
    engine = make_engine(tiny_dirs["llama"], dtype="float32")
    prompt = random_prompts([70], seed=3)[0]
    other = make_engine(tiny_dirs["llama"], dtype="float32")  # the sink-call reference
    ranks: list[int] = []

    async def go():
        loop = await started(engine)
        try:
            slots, want, size = await reserve(loop, engine, prompt)
            metrics = Metrics()
            sink = DecodeSink({"r": Remote(slots, None, "", 0.0)}, loop, metrics,
                              lambda: bool(ranks))
            landed = []
            for layer in range(engine.kv_store.num_layers):
                raw = layer_bytes(engine.kv_store, len(want))
                write_through(sink.landing("r", layer, want, size), raw)
                assert sink.received_bytes == layer * size  # not counted before landed
                sink.landed("r", layer, want, size)
                other.kv_store.import_layer_bytes(layer, want, raw)
                landed.append(raw)
            errors = []
            for rid, blocks, n in (("x", want, size), ("r", want[1:], size),
                                   ("r", want, size + 1)):
                with pytest.raises(TransferError) as err:
                    sink.landing(rid, 0, blocks, n)
                errors.append(str(err.value))
            with pytest.raises(TransferError, match="no KV expected for x"):
                sink.landed("x", 0, want, size)
            ranks.append(1)  # other ranks hold heads of their own: the sink call then
            declined = sink.landing("r", 0, want, size)
            await loop.run(lambda e: e.abort("r"))
        finally:
            await loop.stop()
        return want, landed, sink.received_bytes, metrics.kv_transfer_bytes.total, \
            errors, declined
    want, landed, received, counted, errors, declined = asyncio.run(go())
    assert want and received == counted == sum(map(len, landed))
    for layer, raw in enumerate(landed):
        assert bytes(engine.kv_store.export_layer_bytes(layer, want)) == raw
    assert torch.equal(engine.kv_store.k[:, want], other.kv_store.k[:, want])
    assert torch.equal(engine.kv_store.v[:, want], other.kv_store.v[:, want])
    assert errors[0] == "no KV expected for x" and "reserved" in errors[1]
    assert "KV payload of" in errors[2]
    assert declined is None


async def test_an_shm_transfer_lands_through_the_fused_pass(tiny_dirs, make_engine,
                                                            monkeypatch):
    """End to end over shared memory: every chunk is copied out of the segment straight
    into the reserved blocks (no sink call, no import), and they then hold the bytes the
    prefill side exported."""
    import secrets
    import types

    from common.transfer import make_receiver, make_sender
    from kernels import cpu_copysum

    mod = cpu_copysum._KERNEL.module()
    if mod is None:
        pytest.skip("no C++ compiler: the shm receiver hashes the segment, the sink copies")
    scattered = []

    def scatter_all(source, destinations):
        scattered.append(len(destinations))
        return mod.scatter_all(source, destinations)
    monkeypatch.setattr(cpu_copysum, "kernel", lambda wait=False: types.SimpleNamespace(
        copy_all=mod.copy_all, scatter_all=scatter_all))
    a = make_engine(tiny_dirs["llama"], dtype="float32")
    b = make_engine(tiny_dirs["llama"], dtype="float32")
    prompt = random_prompts([90], seed=5)[0]
    a.add_request("p", prompt, SamplingParams(temperature=0, max_tokens=1), hold_blocks=True)
    while a.has_unfinished_requests():
        a.step()
    loop = await started(b)
    imported = []
    monkeypatch.setattr(loop, "import_layer", lambda *args: imported.append(args))
    token = secrets.token_bytes(16)
    rx = tx = None
    try:
        slots = await loop.run(lambda e: e.reserve_remote_prefill(
            "d", prompt, SamplingParams(max_tokens=2)))
        want = slots.block_ids[slots.num_cached_blocks:]
        src = a.requests["p"].block_table[:len(want)]
        chunks = [(layer, want, bytes(a.kv_store.export_layer_bytes(layer, src)))
                  for layer in range(a.kv_store.num_layers)]
        remote: dict[str, Remote] = {}
        sink = DecodeSink(remote, loop, Metrics(), lambda: False)
        rx = make_receiver("shm", sink=sink)
        await rx.start()
        tx = make_sender("shm")
        remote["d"] = Remote(slots, rx.expect("d", lease_s=30, token=token), "", 0.0)
        await tx.send_many(rx.address, "d", chunks, token=token)
        await tx.finish(rx.address, "d", len(chunks), token=token)
        await remote["d"].transfer.wait()
        await loop.run(lambda e: e.abort("d"))
    finally:
        for part in (tx, rx):
            if part is not None:
                await part.close()
        await loop.stop()
        a.release("p")
    assert imported == [] and scattered and sum(scattered) >= 2 * len(chunks)
    assert sink.received_bytes == sum(len(c[2]) for c in chunks)
    for layer, _, raw in chunks:
        assert bytes(b.kv_store.export_layer_bytes(layer, want)) == raw


def test_the_decode_sink_lands_a_batch_in_two_calls(tiny_dirs, make_engine):
    """``landing_many`` / ``landed_many``: every layer's chunk in the reserved blocks,
    counted once the batch is verified; a batch naming other blocks (a hostile peer) or
    a request no longer waiting (aborted mid-transfer) is a clear error, nothing counted."""
    engine = make_engine(tiny_dirs["llama"], dtype="float32")
    prompt = random_prompts([70], seed=4)[0]

    async def go():
        loop = await started(engine)
        try:
            slots, want, size = await reserve(loop, engine, prompt)
            metrics, remote = Metrics(), {"r": Remote(slots, None, "", 0.0)}
            sink = DecodeSink(remote, loop, metrics, lambda: False)
            layers = list(range(engine.kv_store.num_layers))
            blocks = [list(want) for _ in layers]
            raws = [layer_bytes(engine.kv_store, len(want)) for _ in layers]
            write_through(sink.landing_many("r", layers, blocks, [size] * len(layers)),
                          b"".join(raws))
            before = sink.received_bytes
            sink.landed_many("r", layers, blocks, [size] * len(layers))
            after = sink.received_bytes
            errors = []
            hostile = [list(want) for _ in layers]
            hostile[-1] = [b + 1 for b in want]
            for rid, ids, sizes in (("r", hostile, [size] * len(layers)),
                                    ("r", blocks, [size] * (len(layers) - 1) + [size + 1]),
                                    ("x", blocks, [size] * len(layers))):
                with pytest.raises(TransferError) as err:
                    sink.landing_many(rid, layers, ids, sizes)
                errors.append(str(err.value))
            del remote["r"]  # aborted while its last batch was being verified
            with pytest.raises(TransferError, match="no KV expected for r"):
                sink.landed_many("r", layers, blocks, [size] * len(layers))
            await loop.run(lambda e: e.abort("r"))
        finally:
            await loop.stop()
        return want, raws, before, after, sink.received_bytes, \
            metrics.kv_transfer_bytes.total, errors
    want, raws, before, after, received, counted, errors = asyncio.run(go())
    assert before == 0 and after == received == counted == sum(map(len, raws))
    for layer, raw in enumerate(raws):
        assert bytes(engine.kv_store.export_layer_bytes(layer, want)) == raw
    assert "reserved" in errors[0] and f"{[b + 1 for b in want][:4]}" in errors[0]
    assert "KV payload of" in errors[1] and errors[2] == "no KV expected for x"
