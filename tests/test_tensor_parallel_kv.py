"""KV between tensor-parallel sizes, engine level (CPU, gloo, float64): a TP=2 engine
exports and imports the TP=1 layout (all heads), so its bytes equal a TP=1 engine's,
KV streamed either way continues token for token, and pool blocks cross over too."""

from __future__ import annotations

import pytest
import torch

from common.block_hash import hash_blocks
from common.sampling_params import SamplingParams
from services.engine.config import EngineConfig
from services.engine.core import EngineHooks
from tests.tiny_models import make_tiny_model, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1)


@pytest.fixture
def engines():
    """Build engines; each closed after the test, its followers gone, no block leaked."""
    from services.engine.engine import LLMEngine

    made: list[LLMEngine] = []

    def build(model, tp=1, hooks=None):
        config = EngineConfig(model=str(model), dtype="float64", tensor_parallel_size=tp)
        made.append(LLMEngine(config, hooks=hooks) if hooks else LLMEngine(config))
        return made[-1]

    yield build
    for engine in made:
        engine.close()
        if engine.tp_leader is not None:
            assert all(p.poll() is not None for p in engine.tp_leader.procs)


def prefill(engine, prompt, hooks_sink=None):
    """Run ``prompt`` to its first token holding its blocks; (block table, first token)."""
    rid = engine.add_request(None, prompt, ONE_TOKEN, hold_blocks=True)
    first = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            first = out.new_token_ids[0]
    return rid, list(engine.requests[rid].block_table), first


def stream(src, dst, prompt, params=GREEDY):
    """Prefill in ``src`` (its on_layer hook set up to call ``stream.hook``), streaming
    each layer into blocks ``dst`` reserved, as a prefill worker does; then decode in
    ``dst``. Returns the tokens and the KV bytes moved."""
    slots = dst.reserve_remote_prefill("d", prompt, params)
    moved = 0

    def on_layer(layer, seqs):
        nonlocal moved
        (seq,) = seqs
        payload = src.kv_store.export_layer_bytes(layer, seq.block_table[:len(slots.block_ids)])
        dst.kv_store.import_layer_bytes(layer, slots.block_ids, payload)
        moved += payload.nbytes
    stream.hook = on_layer
    rid, _, first = prefill(src, prompt)
    src.release(rid)
    dst.complete_remote_prefill("d", first)
    tokens = [first]
    while dst.has_unfinished_requests():
        for out in dst.step():
            tokens.extend(out.new_token_ids)
    return tokens, moved


def hooked(build, model, tp):
    return build(model, tp, hooks=EngineHooks(on_layer=lambda l, s: stream.hook(l, s)))


def kv_bytes(prompt_len: int, kv_heads: int = 2) -> int:
    """The tiny model's KV for a prompt: blocks x layers x K|V x tokens x heads x dim x 8."""
    return -(-prompt_len // 16) * 2 * 2 * 16 * kv_heads * 16 * 8


def as_values(raw) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.float64)


def test_tp2_exports_the_tp1_layout(tiny_dirs, engines):
    one = engines(tiny_dirs["llama"])
    two = engines(tiny_dirs["llama"], tp=2)
    assert two.fingerprint == one.fingerprint
    assert two.kv_store.block_nbytes == one.kv_store.block_nbytes == kv_bytes(16)
    prompt = random_prompts([45], seed=7)[0]
    (r1, b1, t1), (r2, b2, t2) = prefill(one, prompt), prefill(two, prompt)
    assert t1 == t2
    # Computed on two ranks, the values differ from one rank's in the last bits only
    # (sharded matmuls sum in another order); in the same places, so the same layout.
    for layer in range(2):  # between steps: a gather of the follower's slice
        want = one.kv_store.export_layer_bytes(layer, [b1[2], b1[0]])
        got = two.kv_store.export_layer_bytes(layer, [b2[2], b2[0]])
        assert got.nbytes == want.nbytes == kv_bytes(32) // 2  # one layer, two blocks
        torch.testing.assert_close(as_values(got), as_values(want), rtol=1e-12, atol=1e-12)
    # TP=1 bytes in, the same bytes out: scattered to the ranks and gathered back.
    dest = [9, 3, 17]
    for layer in range(2):
        want = one.kv_store.export_layer_bytes(layer, b1[:3])
        two.kv_store.import_layer_bytes(layer, dest, want)
        assert bytes(two.kv_store.export_layer_bytes(layer, dest)) == bytes(want)
    for i in range(3):  # the pool's unit: a block across every layer
        want = one.kv_store.export_block_bytes(b1[i])
        assert bytes(two.kv_store.export_block_bytes(dest[i])) == bytes(want)
        two.kv_store.import_block_bytes(dest[i], bytes(want)[::-1])
        assert bytes(two.kv_store.export_block_bytes(dest[i])) == bytes(want)[::-1]
    assert bytes(two.kv_store.export_layer_bytes(0, [])) == b""
    with pytest.raises(ValueError, match="out of range"):
        two.kv_store.export_layer_bytes(0, [10 ** 6])
    with pytest.raises(ValueError, match="bytes"):
        two.kv_store.import_layer_bytes(0, [b2[0]], b"\0" * 7)
    one.release(r1)
    two.release(r2)


def test_layers_streamed_from_tp2_arrive_in_order_for_any_blocks(tiny_dirs, engines):
    # Each layer's slices are gathered while the next computes, the last after the
    # forward: the hook still sees every layer, in order, with the bytes of whatever
    # blocks it asks for (the whole run, a tail of it, a pick out of order).
    two = hooked(engines, tiny_dirs["llama"], 2)
    seen = []

    def on_layer(layer, seqs):
        (seq,) = seqs
        t = seq.block_table
        seen.append((layer, [bytes(two.kv_store.export_layer_bytes(layer, ids))
                             for ids in (t[:3], t[1:3], [t[2], t[0]])]))
    stream.hook = on_layer
    rid, table, _ = prefill(two, random_prompts([45], seed=8)[0])  # three blocks
    assert [layer for layer, _ in seen] == [0, 1]
    for layer, got in seen:  # against gathers between steps, of the same cache
        assert got == [bytes(two.kv_store.export_layer_bytes(layer, ids))
                       for ids in (table[:3], table[1:3], [table[2], table[0]])]
        assert [len(g) for g in got] == [kv_bytes(48) // 2, kv_bytes(32) // 2,
                                         kv_bytes(32) // 2]
    assert two.kv_store.handoff_seconds > 0
    two.release(rid)


def test_kv_streamed_tp1_to_tp2_and_back_continues_exactly(tiny_dirs, engines):
    model = tiny_dirs["qwen2"]
    prompts = random_prompts([37, 16, 5], seed=8)
    alone = engines(model)
    want = [c.token_ids for c in alone.generate(prompts, GREEDY)]
    src_one = hooked(engines, model, 1)
    two = hooked(engines, model, 2)  # decodes what TP=1 prefilled, then prefills for TP=1
    got = [stream(src_one, two, p) for p in prompts]
    assert [t for t, _ in got] == want
    assert [n for _, n in got] == [kv_bytes(len(p)) for p in prompts]
    dst_one = engines(model)
    back = [stream(two, dst_one, p) for p in random_prompts([33, 20], seed=9)]
    want_back = [c.token_ids for c in alone.generate(random_prompts([33, 20], seed=9),
                                                     GREEDY)]
    assert [t for t, _ in back] == want_back
    assert [n for _, n in back] == [kv_bytes(33), kv_bytes(20)]


def test_pool_blocks_cross_tp_sizes_with_a_replicated_kv_head(tmp_path, engines):
    """One KV head on two ranks (replicated): the export holds it once. Blocks exported
    by TP=2 are adopted by TP=1 (and the reverse) and hit as a prefix, exactly."""
    model = make_tiny_model(tmp_path / "mqa", "llama", seed=4, num_key_value_heads=1)
    one, two = engines(model), engines(model, tp=2)
    shared = random_prompts([48], seed=3)[0]
    tail = [7, 8, 9]
    want = one.generate([shared + tail], GREEDY)[0].token_ids
    assert two.kv_store.block_nbytes == one.kv_store.block_nbytes == kv_bytes(16, 1)
    for src, dst in ((two, one), (one, two)):
        rid, _, _ = prefill(src, shared)
        src.release(rid)
        hashes = hash_blocks(shared, 16, src.fingerprint, None)
        data = src.pool_blocks.export(hashes)
        assert len(data) == 3 and all(d.nbytes == kv_bytes(16, 1) for d in data)
        dst.block_manager.reset_prefix_cache()
        assert dst.pool_blocks.adopt(hashes, shared, 0, data) == 3
        got = dst.generate([shared + tail], GREEDY)[0]
        assert got.num_cached_tokens == 48 and got.token_ids == want
        assert bytes(dst.pool_blocks.export(hashes)[2]) == bytes(data[2])



def test_head_slices_land_in_the_all_heads_blocks_and_a_forged_one_writes_nothing():
    """What a TP=1 decode worker does with each prefill rank's slice (the direct path):
    slices of heads [0, 1) and [1, 3) give the blocks a whole export gives; a slice of
    the wrong head range, head count, layer or size is refused before anything moves."""
    from services.engine.kv_cache import KVCache

    src = KVCache(2, 6, 16, 3, 8, torch.float64, torch.device("cpu"))
    src.k.normal_()
    src.v.normal_()
    dst = KVCache(2, 6, 16, 3, 8, torch.float64, torch.device("cpu"))
    for layer in range(2):
        for start, count in ((0, 1), (1, 2)):
            part = torch.stack([src.k[layer, [1, 2], :, start:start + count],
                                src.v[layer, [1, 2], :, start:start + count]]).contiguous()
            dst.import_layer_slice_bytes(layer, [4, 5], (start, count, 3),
                                         memoryview(part.numpy()).cast("B"))
    assert torch.equal(dst.k[:, [4, 5]], src.k[:, [1, 2]])
    assert torch.equal(dst.v[:, [4, 5]], src.v[:, [1, 2]])
    before = (dst.k.clone(), dst.v.clone())
    one_head = memoryview(torch.ones(2, 2, 16, 1, 8, dtype=torch.float64).numpy()).cast("B")
    for layer, heads, payload, match in (
            (0, (3, 1, 4), one_head, "of 4 heads for a cache of 3"),
            (0, (2, 2, 3), one_head, r"\[2, 4\) of 3 heads"),
            (2, (0, 1, 3), one_head, "layer 2 outside"),
            (0, (0, 2, 3), one_head, "where 8192 fit 2 blocks of 2 heads")):
        with pytest.raises(ValueError, match=match):
            dst.import_layer_slice_bytes(layer, [4, 5], heads, payload)
    assert torch.equal(dst.k, before[0]) and torch.equal(dst.v, before[1])


async def test_a_tp_prefill_sends_direct_only_where_the_decode_worker_takes_slices():
    """The path a TP=2 prefill worker picks per request (counted in ``kv_send_paths``):
    direct to an advert that takes slices on tcp, shm or ucx; gathered for a TP decode
    worker's advert without slices, or one whose ranks lack the backend; a one-rank
    engine picks neither."""
    import asyncio
    import collections
    from types import SimpleNamespace

    from common.records import KVAdvert, RankAdvert
    from services.worker.prefill_role import Job, PrefillRole

    role = PrefillRole.__new__(PrefillRole)  # only its path choice, no worker around it
    role.ctx = SimpleNamespace(loop=SimpleNamespace(facts=SimpleNamespace(num_layers=2)))
    role.paths, role._slicing = collections.Counter(), ([(0, 1, 2), (1, 1, 2)], True)
    slices = KVAdvert("h", {"tcp": "tcp://127.0.0.1:1"}, slices=True)
    whole = KVAdvert("h", {"tcp": "tcp://127.0.0.1:1"})
    picked = []
    for advert, backend in ((slices, "tcp"), (slices, "shm"), (slices, "ucx"),
                            (whole, "tcp"), (None, "tcp")):
        job = Job(SimpleNamespace(kv_advert=advert), "", asyncio.get_running_loop()
                  .create_future())
        await role._choose_path("r", job, backend)
        picked.append((job.heads, sum(job.finish.values())))
    assert picked == [((0, 1, 2), 4)] * 3 + [(None, 0)] * 2
    assert role.paths == {"direct": 3, "gathered": 2}
    role.paths, role._slicing = collections.Counter(), ([(0, 2, 2)], False)
    await role._choose_path("r", Job(SimpleNamespace(kv_advert=slices), "", None), "tcp")
    assert role.paths == {}
    # A TP=2 decode worker listing its ranks: rank 0 of a one-rank prefill worker sends
    # each decode rank the head it holds, numbered as that rank holds it.
    ranked = KVAdvert("h", {"tcp": "tcp://a:1"}, slices=True, ranks=[
        RankAdvert({"tcp": "tcp://a:1"}, 0, 1), RankAdvert({"tcp": "tcp://a:2"}, 1, 1)])
    job = Job(SimpleNamespace(kv_advert=ranked), "tcp://a:1", None)
    await role._choose_path("r", job, "tcp")
    assert job.targets == ((0, "tcp://a:1", 0, 1, (0, 1, 1)), (0, "tcp://a:2", 1, 1, (0, 1, 1)))
    assert job.finish == {"tcp://a:1": 2, "tcp://a:2": 2} and role.paths == {"direct": 1}
    # On ucx the same, each decode rank at its ucx endpoint; a rank without one (a
    # worker whose followers serve other backends) keeps the gather path.
    ranked_ucx = KVAdvert("h", {"ucx": "ucx://a:3"}, slices=True, ranks=[
        RankAdvert({"ucx": "ucx://a:3"}, 0, 1), RankAdvert({"ucx": "ucx://a:4"}, 1, 1)])
    job = Job(SimpleNamespace(kv_advert=ranked_ucx), "ucx://a:3", None)
    await role._choose_path("r", job, "ucx")
    assert job.targets == ((0, "ucx://a:3", 0, 1, (0, 1, 1)), (0, "ucx://a:4", 1, 1, (0, 1, 1)))
    assert job.finish == {"ucx://a:3": 2, "ucx://a:4": 2} and role.paths == {"direct": 2}
    role._slicing = ([(0, 1, 2), (1, 1, 2)], True)
    job = Job(SimpleNamespace(kv_advert=ranked), "ucx://a:3", None)
    await role._choose_path("r", job, "ucx")
    assert (job.heads, job.targets, job.finish) == (None, (), {})
    assert role.paths == {"direct": 2, "gathered": 1}
