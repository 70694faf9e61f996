"""The paged CPU decode kernel's bfloat16 dot-product path (v9) over a bfloat16 cache:
q rounded to bfloat16 once per sequence and head, scores as float sums of bf16 products,
probabilities rounded to bfloat16 and normalised by their own sum. Held to a float64
reference that rounds q and p the same way, and to exact attention within bfloat16's
error; the widening path (v8) stays exact on the same cache."""

from __future__ import annotations

import pytest
import torch

from services.engine import attention_paged_cpu
from tests.test_attention_paged_cpu import (
    _cache,
    _in_place_on_one_and_two_threads,
    _last_slots,
    _qkv_rows,
    _reference,
)
from tests.test_attention_paged_cpu import needs_compiler as compiler

pytestmark = compiler

# Measured against _dot_reference: up to 5e-5 (one probability whose rounding to bf16
# tips the other way where the kernel's exp and torch's differ in the last float bit).
DOT_ATOL = 1e-3
# Against exact attention: q and p carry 8 significant bits, so ~2^-8 of the values'
# scale (randn values: ~1), here a few 1e-3.
EXACT_ATOL = 2e-2

CASES = [
    ([1], 16, 1, 1, 16),                              # one token: p = 1 exactly
    ([5, 16, 17, 1, 300, 33], 16, 3, 9, 64),          # ragged, block edges, GQA 3
    ([7, 2, 40, 9], 4, 2, 8, 32),                     # small blocks, GQA 4
    ([64, 63, 65], 32, 4, 4, 128),                    # no GQA, head_dim 128
    ([700, 20, 641], 16, 3, 9, 64),                   # many blocks, mixed lengths
    ([50, 24, 23, 25], 24, 2, 12, 32),                # a full and a part tile, GQA 6
    ([30, 61], 8, 1, 7, 128),                         # MQA: heads in passes of 4 and 3
    ([9, 3, 10, 5], 5, 1, 3, 64),                     # odd blocks: each block's last token alone
    ([33, 2], 16, 2, 2, 16),                          # head_dim 16: half a 32-element chunk
]


@pytest.fixture(scope="module")
def dot():
    if not attention_paged_cpu.bf16_dot():
        pytest.skip("no AVX512_BF16 here: a bfloat16 cache takes the widening path")


def _dot_reference(q, k_cache, v_cache, tables, lens):
    """v9's arithmetic in float64: q rounded to bfloat16, scores rounded to float32 (the
    kernel's sums), p = exp(s - max) rounded to bfloat16, out = sum p V / sum p."""
    out = []
    rep = q.shape[1] // k_cache.shape[2]
    qb = q.bfloat16().double()
    for i, n in enumerate(lens.tolist()):
        keys = k_cache[tables[i]].flatten(0, 1)[:n].double().repeat_interleave(rep, 1)
        values = v_cache[tables[i]].flatten(0, 1)[:n].double().repeat_interleave(rep, 1)
        s = (torch.einsum("hd,thd->ht", qb[i], keys) * q.shape[-1] ** -0.5).float()
        p = torch.exp(s - s.max(-1, keepdim=True).values).bfloat16().double()
        out.append(torch.einsum("ht,thd->hd", p, values) / p.sum(-1, keepdim=True))
    return torch.stack(out)


@pytest.mark.parametrize("lens,block_size,kv_heads,heads,dim", CASES)
def test_dot_path_equals_the_rounding_reference(dot, lens, block_size, kv_heads, heads, dim):
    q, k_cache, v_cache, tables, ctx = _cache(lens, block_size, kv_heads, heads, dim, seed=3)
    kb, vb = k_cache.bfloat16(), v_cache.bfloat16()
    got = torch.full_like(q, float("nan"))
    attention_paged_cpu.paged_decode(q, kb, vb, tables, ctx, got)
    torch.testing.assert_close(got.double(), _dot_reference(q, kb, vb, tables, ctx),
                               rtol=0, atol=DOT_ATOL)
    exact = _reference(q, kb.float(), vb.float(), tables, ctx)
    torch.testing.assert_close(got.double(), exact, rtol=0, atol=EXACT_ATOL)
    widened = torch.full_like(q, float("nan"))
    attention_paged_cpu.paged_decode(q, kb, vb, tables, ctx, widened, widen=True)
    torch.testing.assert_close(widened.double(), exact, rtol=1e-5, atol=1e-5)
    if max(lens) > 1:  # the rounding of q and p is what the test sees
        assert not torch.equal(got, widened)
    else:
        row = vb[tables[0, 0], 0].float()  # softmax of one score: p = 1, out = V's row
        assert torch.equal(got, row.repeat_interleave(heads // kv_heads, 0)[None])


def test_dot_path_reads_queries_in_place_and_threads_split_by_work(dot):
    # q as the model hands it over (rows of the fused QKV projection); one thread and
    # two give the same bits, each thread with its own rounded q and probabilities.
    lens = [600, 3, 5, 400, 7, 9, 11, 250]
    q, k_cache, v_cache, tables, ctx = _cache(lens, 16, 3, 9, 64, seed=3)
    kb, vb = k_cache.bfloat16(), v_cache.bfloat16()
    outs = _in_place_on_one_and_two_threads(q, kb, vb, tables, ctx)
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[0].double(), _dot_reference(q, kb, vb, tables, ctx),
                               rtol=0, atol=DOT_ATOL)


@pytest.mark.parametrize("spike", [0, 701, 999])
def test_dot_path_one_dominant_token_in_a_long_context(dot, spike):
    # Score ~ +200 for one key, ~ 0 for 999 others: p rounds to 1 there and to 0 elsewhere
    # (exp(-200)), so the output is that token's value row wherever it sits.
    q, k_cache, v_cache, tables, ctx = _cache([1000, 40], 16, 1, 3, 64, seed=8)
    k_cache *= 0.01
    block, pos = int(tables[0, spike // 16]), spike % 16
    k_cache[block, pos, 0] = q[0, 0] * 200 / q[0, 0].norm()
    kb, vb = k_cache.bfloat16(), v_cache.bfloat16()
    out = torch.empty_like(q)
    attention_paged_cpu.paged_decode(q, kb, vb, tables, ctx, out)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[0, 0], vb[block, pos, 0].float(), rtol=0, atol=1e-6)
    torch.testing.assert_close(out.double(), _dot_reference(q, kb, vb, tables, ctx),
                               rtol=0, atol=DOT_ATOL)


def test_dot_path_large_scores_stay_finite(dot):
    q, k_cache, v_cache, tables, ctx = _cache([50, 3], 16, 2, 4, 16, seed=4)
    q *= 40  # scores in the hundreds
    kb, vb = k_cache.bfloat16(), v_cache.bfloat16()
    out = torch.empty_like(q)
    attention_paged_cpu.paged_decode(q, kb, vb, tables, ctx, out)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), _dot_reference(q, kb, vb, tables, ctx),
                               rtol=0, atol=DOT_ATOL)


def test_dot_path_ignores_what_lies_past_each_context(dot):
    # The cache rows after a context's last token (in its last block, and an odd
    # block's pair partner) hold NaN: nothing of them reaches the output.
    q, k_cache, v_cache, tables, ctx = _cache([9, 3, 21], 5, 1, 3, 64, seed=9)
    want = _dot_reference(q, k_cache.bfloat16(), v_cache.bfloat16(), tables, ctx)
    used = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for i, n in enumerate(ctx.tolist()):
        for t in range(n):
            used[tables[i, t // 5], t % 5] = True
    k_cache[~used] = float("nan")
    v_cache[~used] = float("nan")
    out = torch.empty_like(q)
    attention_paged_cpu.paged_decode(q, k_cache.bfloat16(), v_cache.bfloat16(), tables, ctx, out)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=DOT_ATOL)


@pytest.mark.parametrize("bad", ["block", "length", "zero"])
def test_dot_path_refuses_bad_tables_before_reading(dot, bad):
    q, k_cache, v_cache, tables, ctx = _cache([20, 3], 16, 1, 2, 64)
    if bad == "block":
        tables[0, 1] = k_cache.shape[0]
    elif bad == "length":
        ctx[1] = tables.shape[1] * 16 + 1
    else:
        ctx[0] = 0
    out = torch.zeros_like(q)
    with pytest.raises(RuntimeError, match="out of range"):
        attention_paged_cpu.paged_decode(q, k_cache.bfloat16(), v_cache.bfloat16(), tables,
                                         ctx, out)
    assert not out.any()


def test_dot_products_are_refused_on_a_float32_cache(dot):
    q, k_cache, v_cache, tables, ctx = _cache([20, 3], 16, 1, 2, 64)
    out = torch.zeros_like(q)
    mod = attention_paged_cpu._KERNEL.module()
    with pytest.raises(RuntimeError, match="need a bfloat16 cache"):
        mod.paged_decode(q, k_cache, v_cache, tables, ctx, out, 0.125, True)
    assert not out.any()
    # The Python entry never asks for them there: the float32 path, exact.
    attention_paged_cpu.paged_decode(q, k_cache, v_cache, tables, ctx, out)
    torch.testing.assert_close(out.double(), _reference(q, k_cache, v_cache, tables, ctx),
                               rtol=1e-5, atol=1e-5)


def test_write_decode_takes_the_dot_path_on_a_bf16_cache(dot):
    lens = [17, 32, 5]
    _, k_cache, v_cache, tables, ctx = _cache(lens, 16, 3, 9, 64, seed=11)
    q, k, v = _qkv_rows(3, 9, 3, 64, seed=12)
    slots = _last_slots(tables, lens, 16)
    kc, vc = k_cache.bfloat16(), v_cache.bfloat16()
    got = attention_paged_cpu.write_decode(q, k, v, kc, vc, slots, tables, ctx)
    torch.testing.assert_close(got.double(), _dot_reference(q, kc, vc, tables, ctx),
                               rtol=0, atol=DOT_ATOL)
    widened = attention_paged_cpu.write_decode(q, k, v, kc, vc, slots, tables, ctx, widen=True)
    want = torch.empty_like(q)
    attention_paged_cpu.paged_decode(q, kc, vc, tables, ctx, want, widen=True)
    assert torch.equal(widened, want) and not torch.equal(got, widened)


def test_engine_answers_on_the_dot_path_as_on_the_widening_one(dot, tiny_dirs, make_engine,
                                                               monkeypatch):
    # A bfloat16-KV engine, decode attention in the paged kernel (its default path),
    # with dot products and with them turned off.
    from common.sampling_params import SamplingParams

    prompts = [[1, 5, 9, 200, 17, 3, 3, 8, 40, 41, 42, 7, 6, 5, 4, 3, 2, 100, 101],
               [1, 77], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    runs = {}
    for widen in (False, True):
        if widen:
            monkeypatch.setattr(attention_paged_cpu, "_dot", lambda mod, k_cache, w: False)
        engine = make_engine(tiny_dirs["llama"], dtype="float32", block_size=4,
                             num_kv_blocks=64, kv_cache_dtype="bfloat16")
        outs = engine.generate(prompts, params)
        runs[widen] = ([o.token_ids for o in outs],
                       [[lp.logprob for lp in o.logprobs] for o in outs])
    # The tiny model's greedy tokens stay the same; log-probabilities move by up to
    # ~0.008 (measured), the prefill's first token (torch attention) not at all.
    assert runs[False][0] == runs[True][0] and all(len(t) == 12 for t in runs[False][0])
    for got, want in zip(runs[False][1], runs[True][1], strict=True):
        assert got[0] == want[0]
        assert got == pytest.approx(want, abs=3e-2)
    assert runs[False][1] != runs[True][1]  # and the dot path is the one that ran
