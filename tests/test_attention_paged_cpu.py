"""The compiled CPU decode kernel (attention_paged_cpu.py), which reads the paged cache in
place, against plain float64 attention over each sequence's gathered context."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from common.sampling_params import SamplingParams
from services.engine import attention_paged_cpu
from services.engine.attention import (
    AttentionMetadata,
    DecodeGroup,
    PagedDecodes,
    PrefillSegment,
    TorchAttention,
)

needs_compiler = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None,
                                    reason="no C++ compiler: decode takes the torch chunked path")
pytestmark = needs_compiler


def _cache(lens, block_size, kv_heads, heads, dim, seed=0, width_pad=1):
    """A shuffled float32 cache, each sequence's blocks scattered in it, and its queries."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 5
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(len(lens), max(need) + width_pad, dtype=torch.long)
    for i, k in enumerate(need):
        for j in range(k):
            tables[i, j] = free.pop()
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g)
    q = torch.randn(len(lens), heads, dim, generator=g)
    return q, k_cache, v_cache, tables, torch.tensor(lens)


def _reference(q, k_cache, v_cache, tables, lens):
    out = []
    rep = q.shape[1] // k_cache.shape[2]
    for i, n in enumerate(lens.tolist()):
        keys = k_cache[tables[i]].flatten(0, 1)[:n].double().repeat_interleave(rep, 1)
        values = v_cache[tables[i]].flatten(0, 1)[:n].double().repeat_interleave(rep, 1)
        scores = torch.einsum("hd,thd->ht", q[i].double(), keys) * q.shape[-1] ** -0.5
        out.append(torch.einsum("ht,thd->hd", scores.softmax(-1), values))
    return torch.stack(out)


@pytest.mark.parametrize("lens,block_size,kv_heads,heads,dim", [
    ([1], 16, 1, 1, 16),                              # one token: softmax of one score
    ([5, 16, 17, 1, 300, 33], 16, 3, 9, 64),          # ragged, on and off block edges, GQA 3
    ([7, 2, 40, 9], 4, 2, 8, 32),                     # small blocks, GQA 4
    ([64, 63, 65], 32, 4, 4, 128),                    # no GQA, wide heads
])
def test_kernel_equals_reference_attention(lens, block_size, kv_heads, heads, dim):
    q, k_cache, v_cache, tables, ctx = _cache(lens, block_size, kv_heads, heads, dim)
    out = torch.full_like(q, float("nan"))
    attention_paged_cpu.paged_decode(q, k_cache, v_cache, tables, ctx, out)
    torch.testing.assert_close(out.double(), _reference(q, k_cache, v_cache, tables, ctx),
                               rtol=1e-5, atol=1e-5)


def test_large_scores_do_not_overflow():
    # Scores in the hundreds: without the running maximum exp() would overflow to inf.
    q, k_cache, v_cache, tables, ctx = _cache([50, 3], 16, 2, 4, 16, seed=4)
    q *= 40
    out = torch.empty_like(q)
    attention_paged_cpu.paged_decode(q, k_cache, v_cache, tables, ctx, out)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), _reference(q, k_cache, v_cache, tables, ctx),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("spike", [0, 700, 999])
def test_one_dominant_token_anywhere_in_a_long_context(spike):
    # One key far more aligned with the query than the other 999 (score ~ +200, the
    # rest ~ 0): the softmax's maximum is taken over the whole context, so the output is
    # that token's value row wherever it sits, and nothing overflows.
    q, k_cache, v_cache, tables, ctx = _cache([1000, 40], 16, 1, 3, 64, seed=8)
    k_cache *= 0.01
    block, pos = int(tables[0, spike // 16]), spike % 16
    k_cache[block, pos, 0] = q[0, 0] * 200 / q[0, 0].norm()
    out = torch.empty_like(q)
    attention_paged_cpu.paged_decode(q, k_cache, v_cache, tables, ctx, out)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[0, 0], v_cache[block, pos, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), _reference(q, k_cache, v_cache, tables, ctx),
                               rtol=1e-5, atol=1e-5)


def test_ready_starts_the_build_and_reports_it():
    attention_paged_cpu.ready()
    assert attention_paged_cpu.available()  # waits for the build ready() started
    assert attention_paged_cpu.ready()


@pytest.mark.parametrize("bad", ["block", "length", "zero"])
def test_bad_tables_are_refused_before_reading(bad):
    q, k_cache, v_cache, tables, ctx = _cache([20, 3], 16, 1, 2, 16)
    if bad == "block":
        tables[0, 1] = k_cache.shape[0]  # one past the cache
    elif bad == "length":
        ctx[1] = tables.shape[1] * 16 + 1  # longer than its table
    else:
        ctx[0] = 0
    out = torch.zeros_like(q)
    with pytest.raises(RuntimeError, match="out of range"):
        attention_paged_cpu.paged_decode(q, k_cache, v_cache, tables, ctx, out)
    assert not out.any()  # nothing written


def test_backend_takes_the_kernel_for_float32_and_matches_gather():
    # Two decode groups, the queries after a prefill-free batch: the backend writes each
    # group's rows of its output through the kernel and equals the gathering path.
    q, k_cache, v_cache, tables, ctx = _cache([9, 30, 4, 17, 2], 4, 2, 6, 16, seed=2)
    assert attention_paged_cpu.supports(q, k_cache)
    assert not attention_paged_cpu.supports(q.double(), k_cache.double())
    groups = [DecodeGroup(0, 2, tables[:2], ctx[:2], 30),
              DecodeGroup(2, 3, tables[2:], ctx[2:], 17)]
    # Each query's own K/V goes in at its last position, as the model does.
    last = [tables[i, (n - 1) // 4] * 4 + (n - 1) % 4 for i, n in enumerate(ctx.tolist())]
    g = torch.Generator().manual_seed(9)
    k = torch.randn(5, 2, 16, generator=g)
    v = torch.randn(5, 2, 16, generator=g)
    outs = {}
    for path in ("paged", "auto", "gather"):  # "paged" waits for the build
        meta = AttentionMetadata(torch.tensor(last), groups, [])
        kc, vc = k_cache.clone(), v_cache.clone()
        outs[path] = TorchAttention(path).forward(q, k, v, kc, vc, meta)
    torch.testing.assert_close(outs["paged"], outs["gather"], rtol=1e-5, atol=1e-5)
    assert torch.equal(outs["auto"], outs["paged"])
    kc = k_cache.clone()
    kc.view(-1, 2, 16)[torch.tensor(last)] = k
    vc = v_cache.clone()
    vc.view(-1, 2, 16)[torch.tensor(last)] = v
    torch.testing.assert_close(outs["paged"].double(), _reference(q, kc, vc, tables, ctx),
                               rtol=1e-5, atol=1e-5)


def test_engine_greedy_tokens_equal_on_kernel_and_gather(tiny_dirs, make_engine):
    prompts = [[1, 5, 9, 200, 17, 3, 3, 8, 40, 41, 42, 7, 6, 5, 4, 3, 2, 100, 101],
               [1, 77], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = {}
    for path in ("gather", "paged"):
        engine = make_engine(tiny_dirs["llama"], dtype="float32", block_size=4,
                             num_kv_blocks=64)
        engine.model.backend = TorchAttention(path)
        tokens[path] = [c.token_ids for c in engine.generate(prompts, params)]
    assert tokens["paged"] == tokens["gather"]
    assert all(len(t) == 12 for t in tokens["paged"])


@pytest.mark.parametrize("lens,block_size,kv_heads,heads,dim", [
    ([16, 32, 48, 17, 33, 1], 16, 3, 9, 64),      # contexts on and just past block edges
    ([700, 20, 641], 16, 3, 9, 64),                # 44 blocks: many online-softmax rescales
    ([50, 24, 23, 25], 24, 2, 12, 32),             # 24-token blocks: a full and a part tile
    ([37, 5], 16, 2, 12, 64),                      # 6 query heads per KV head: passes of 4+2
    ([30, 61], 8, 1, 7, 128),                      # MQA, 7 heads: passes of 4+3, wide heads
    ([19, 40], 16, 2, 4, 48),                      # head_dim 48: the portable loop
    ([3, 1200, 5, 17], 16, 3, 9, 64),              # the longest context sizes the score rows
])
def test_kernel_cases_equal_reference(lens, block_size, kv_heads, heads, dim):
    q, k_cache, v_cache, tables, ctx = _cache(lens, block_size, kv_heads, heads, dim, seed=7)
    out = torch.full_like(q, float("nan"))
    attention_paged_cpu.paged_decode(q, k_cache, v_cache, tables, ctx, out)
    torch.testing.assert_close(out.double(), _reference(q, k_cache, v_cache, tables, ctx),
                               rtol=1e-5, atol=1e-5)


def _in_place_on_one_and_two_threads(q, k_cache, v_cache, tables, ctx):
    """paged_decode of q as the model hands it over (rows of the fused QKV projection,
    not contiguous), on one thread and on two: the two outputs."""
    n, heads, dim = q.shape
    wide = torch.randn(n, heads * dim + 2 * k_cache.shape[2] * dim)
    wide[:, :heads * dim] = q.reshape(n, -1)
    qv = wide[:, :heads * dim].view(n, heads, dim)
    assert not qv.is_contiguous()
    outs = []
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            out = torch.empty_like(q)
            attention_paged_cpu.paged_decode(qv, k_cache, v_cache, tables, ctx, out)
            outs.append(out)
    finally:
        torch.set_num_threads(threads)
    return outs


def test_queries_are_read_in_place_and_threads_split_by_work():
    # One thread and two (the batch split by context length) give the same bits.
    lens = [600, 3, 5, 400, 7, 9, 11, 250]
    q, k_cache, v_cache, tables, ctx = _cache(lens, 16, 3, 9, 64, seed=3)
    outs = _in_place_on_one_and_two_threads(q, k_cache, v_cache, tables, ctx)
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[0].double(), _reference(q, k_cache, v_cache, tables, ctx),
                               rtol=1e-5, atol=1e-5)


def test_decode_groups_become_one_call_per_run():
    a = DecodeGroup(0, 2, torch.tensor([[3, 4], [5, 0]]), torch.tensor([20, 9]), 20)
    b = DecodeGroup(2, 1, torch.tensor([[6, 7, 8]]), torch.tensor([40]), 40)
    c = DecodeGroup(7, 1, torch.tensor([[9]]), torch.tensor([2]), 2)  # not adjacent to b
    (s0, n0, t0, l0), (s1, n1, t1, l1) = PagedDecodes.of([a, b, c]).calls
    assert (s0, n0, s1, n1) == (0, 3, 7, 1)
    assert t0.tolist() == [[3, 4, 0], [5, 0, 0], [6, 7, 8]]
    assert l0.tolist() == [20, 9, 40] and l1.tolist() == [2] and t1.tolist() == [[9]]


def _qkv_rows(n, heads, kv_heads, dim, seed):
    """q, k and v as the model hands them over: views into one fused projection's rows."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=g)
    q = wide[:, :heads * dim].view(n, heads, dim)
    k = wide[:, heads * dim:(heads + kv_heads) * dim].view(n, kv_heads, dim)
    return q, k, wide[:, (heads + kv_heads) * dim:].view(n, kv_heads, dim)


def _last_slots(tables, lens, block_size):
    """Each sequence's newest token's slot: the first, last or a middle slot of a block."""
    return torch.tensor([int(tables[i, (n - 1) // block_size]) * block_size
                         + (n - 1) % block_size for i, n in enumerate(lens)])


# Contexts that end on a block's first token, its last, and one past it (a new block).
WRITE_CASES = pytest.mark.parametrize("lens,block_size,kv_heads,heads,dim", [
    ([1, 16, 17, 32, 33, 48], 16, 3, 9, 64), ([4, 5, 8, 1, 9], 4, 2, 4, 16)])


@WRITE_CASES
def test_write_decode_equals_index_copy_then_paged_decode(lens, block_size, kv_heads, heads,
                                                          dim):
    _, k_cache, v_cache, tables, ctx = _cache(lens, block_size, kv_heads, heads, dim, seed=11)
    q, k, v = _qkv_rows(len(lens), heads, kv_heads, dim, seed=12)
    assert not k.is_contiguous()
    slots = _last_slots(tables, lens, block_size)
    kc, vc = k_cache.clone(), v_cache.clone()
    kc.view(-1, kv_heads, dim).index_copy_(0, slots, k)
    vc.view(-1, kv_heads, dim).index_copy_(0, slots, v)
    want = torch.empty(q.shape)
    attention_paged_cpu.paged_decode(q, kc, vc, tables, ctx, want)
    kg, vg = k_cache.clone(), v_cache.clone()
    got = attention_paged_cpu.write_decode(q, k, v, kg, vg, slots, tables, ctx)
    assert torch.equal(kg, kc) and torch.equal(vg, vc)  # the same bytes, the same places
    assert torch.equal(got, want) and got.shape == q.shape


@pytest.mark.parametrize("bad", ["past", "negative"])
def test_write_decode_refuses_a_bad_slot_before_writing(bad):
    lens = [20, 3]
    _, k_cache, v_cache, tables, ctx = _cache(lens, 16, 1, 2, 16)
    q, k, v = _qkv_rows(2, 2, 1, 16, seed=1)
    slots = _last_slots(tables, lens, 16)
    slots[1] = k_cache.shape[0] * 16 if bad == "past" else -1
    kc, vc = k_cache.clone(), v_cache.clone()
    with pytest.raises(RuntimeError, match="slot out of range"):
        attention_paged_cpu.write_decode(q, k, v, kc, vc, slots, tables, ctx)
    assert torch.equal(kc, k_cache) and torch.equal(vc, v_cache)  # row 0 not written either


def test_backend_writes_and_attends_decode_only_steps_in_one_call(monkeypatch):
    # A decode-only step: every layer (the first, which plans, included) makes one native
    # call; with a prefill in the step the two-call path runs. Same bits either way.
    lens = [9, 16, 17, 4]
    _, k_cache, v_cache, tables, ctx = _cache(lens, 4, 2, 6, 16, seed=5)
    q, k, v = _qkv_rows(4, 6, 2, 16, seed=6)
    slots = _last_slots(tables, lens, 4)
    calls = []
    real = attention_paged_cpu.write_decode
    monkeypatch.setattr(attention_paged_cpu, "write_decode",
                        lambda *a: calls.append(1) or real(*a))
    backend = TorchAttention("paged")
    meta = AttentionMetadata(slots, [DecodeGroup(0, 2, tables[:2], ctx[:2], 16),
                                     DecodeGroup(2, 2, tables[2:], ctx[2:], 17)], [])
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(3)]
    outs = [backend.forward(q, k, v, kc, vc, meta) for kc, vc in caches]
    assert len(calls) == 3 and meta.prepared.whole is not None
    kc, vc = k_cache.clone(), v_cache.clone()
    kc.view(-1, 2, 16).index_copy_(0, slots, k)
    vc.view(-1, 2, 16).index_copy_(0, slots, v)
    want = torch.empty(q.shape)
    attention_paged_cpu.paged_decode(q, kc, vc, tables, ctx, want)
    for out, (kg, vg) in zip(outs, caches, strict=True):
        assert torch.equal(out, want) and torch.equal(kg, kc) and torch.equal(vg, vc)
    # Add a prefill segment (2 fresh tokens of a new sequence) after the decodes.
    q2, k2, v2 = _qkv_rows(6, 6, 2, 16, seed=6)
    q2[:4], k2[:4], v2[:4] = q, k, v
    spare = [b for b in range(k_cache.shape[0]) if b not in tables.flatten().tolist()][0]
    meta = AttentionMetadata(torch.cat([slots, torch.tensor([spare * 4, spare * 4 + 1])]),
                             meta.decode_groups, [PrefillSegment(4, 2, 2, torch.tensor([spare]))])
    kg, vg = k_cache.clone(), v_cache.clone()
    out = backend.forward(q2, k2, v2, kg, vg, meta)
    assert len(calls) == 3 and meta.prepared.whole is None
    assert torch.equal(out[:4], want) and torch.equal(kg.view(-1, 2, 16)[slots], k)


def test_one_call_covers_the_step_only_without_gaps_or_prefills():
    a = DecodeGroup(0, 2, torch.tensor([[3, 4], [5, 0]]), torch.tensor([20, 9]), 20)
    b = DecodeGroup(2, 1, torch.tensor([[6, 7, 8]]), torch.tensor([40]), 40)
    tables, lens = PagedDecodes.of([a, b], 3).whole
    assert tables.tolist() == [[3, 4, 0], [5, 0, 0], [6, 7, 8]] and lens.tolist() == [20, 9, 40]
    assert PagedDecodes.of([a, b], 5).whole is None  # prefill tokens after the decodes
    assert PagedDecodes.of([a, b]).whole is None
    assert PagedDecodes.of([b], 1).whole is None  # starts at row 2, not 0
    assert PagedDecodes.of([], 0).whole is None


def test_engine_tokens_and_logprobs_equal_with_one_call_and_two(tiny_dirs, make_engine,
                                                                 monkeypatch):
    # w4a16 batch decode (fused layers): every decode step's layers take write_decode;
    # then the same with the one-call plan withheld (index_copy_s, then paged_decode).
    prompts = [[1, 5, 9, 200, 17, 3, 3, 8, 40, 41, 42, 7, 6, 5, 4, 3, 2, 100], [1, 77],
               [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    calls = []
    real = attention_paged_cpu.write_decode
    monkeypatch.setattr(attention_paged_cpu, "write_decode",
                        lambda *a: calls.append(1) or real(*a))

    def run():
        engine = make_engine(tiny_dirs["llama"], dtype="float32", quantization="w4a16",
                             block_size=4, num_kv_blocks=64)
        engine.model.backend = TorchAttention("paged")
        outs = engine.generate(prompts, params)
        return [o.token_ids for o in outs], [[lp.top for lp in o.logprobs] for o in outs]
    one = run()
    assert calls
    made = len(calls)
    plan = PagedDecodes.of
    monkeypatch.setattr(PagedDecodes, "of", staticmethod(lambda groups, n=-1: plan(groups)))
    two = run()
    assert len(calls) == made  # the two-call path ran throughout
    assert one == two and all(len(t) == 12 for t in one[0])
