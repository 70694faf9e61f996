"""Each Triton kernel in kernels/ against its torch reference.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1,
set here before any kernel is defined); with CUDA they run on the GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed")

from kernels.decode_attention import paged_decode_attention, paged_decode_attention_ref  # noqa: E402
from kernels.kv_pack import kv_pack, kv_pack_ref, kv_unpack, kv_unpack_ref  # noqa: E402
from kernels.kv_write import write_kv, write_kv_ref  # noqa: E402
from kernels.prefill_attention import (  # noqa: E402
    paged_prefill_attention,
    paged_prefill_attention_ref,
)
from kernels.rms_norm import rms_norm, rms_norm_ref  # noqa: E402
from kernels.rotary import rotary_embedding, rotary_embedding_ref  # noqa: E402
from services.engine.model import rope_inv_freq  # noqa: E402
from services.engine.model_config import RopeScaling  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {"atol": 2e-5, "rtol": 1e-4}


def _cache(num_blocks, block_size, kvh, head_dim, gen, dtype=torch.float32):
    shape = (num_blocks, block_size, kvh, head_dim)
    return (torch.randn(shape, generator=gen, dtype=dtype).to(DEV),
            torch.randn(shape, generator=gen, dtype=dtype).to(DEV))


def _tables(lens, block_size, num_blocks, gen):
    """Disjoint random blocks per sequence, padded with block 0."""
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(1, max(-(-n // block_size) for n in lens))
    rows = []
    for n in lens:
        need = -(-n // block_size)
        rows.append(perm[:need] + [0] * (width - need))
        perm = perm[need:]
    return torch.tensor(rows, dtype=torch.int32, device=DEV)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads,kvh", [(4, 4), (8, 2), (16, 2)])
def test_decode_attention_matches_reference(heads, kvh, head_dim):
    gen = torch.Generator().manual_seed(heads * head_dim)
    bs = 16
    lens = [1, 15, 16, 17, 70]  # inside, at and across block boundaries
    k_cache, v_cache = _cache(40, bs, kvh, head_dim, gen)
    tables = _tables(lens, bs, 40, gen)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEV)
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(DEV)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, head_dim ** -0.5)
    for split_len in (None, 32):  # one split, and several merged by the reduce
        out = paged_decode_attention(q, k_cache, v_cache, tables, ctx, head_dim ** -0.5,
                                     split_len=split_len)
        torch.testing.assert_close(out, ref, **TOL)


def test_decode_attention_block_size_not_a_power_of_two():
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = _cache(12, 5, 2, 64, gen)
    lens = [3, 11, 23]
    tables = _tables(lens, 5, 12, gen)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEV)
    q = torch.randn(3, 4, 64, generator=gen).to(DEV)
    torch.testing.assert_close(
        paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.125, split_len=32),
        paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, 0.125), **TOL)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads,kvh", [(4, 4), (8, 2), (16, 2)])
def test_prefill_attention_varlen_with_cached_prefixes(heads, kvh, head_dim):
    gen = torch.Generator().manual_seed(heads + head_dim)
    bs = 16
    # (cached prefix, new tokens): none cached, a partial block, whole blocks, an empty
    # segment, a single token, a chunk straddling several blocks.
    shapes = [(0, 20), (5, 3), (32, 17), (16, 0), (47, 1), (3, 40)]
    lens = [p + n for p, n in shapes]
    k_cache, v_cache = _cache(40, bs, kvh, head_dim, gen)
    tables = _tables(lens, bs, 40, gen)
    qs = torch.tensor([0] + torch.tensor([n for _, n in shapes]).cumsum(0).tolist(),
                      dtype=torch.int32, device=DEV)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEV)
    q = torch.randn(int(qs[-1]), heads, head_dim, generator=gen).to(DEV)
    max_q = max(n for _, n in shapes)
    args = (q, k_cache, v_cache, tables, qs, ctx, max_q, head_dim ** -0.5)
    torch.testing.assert_close(paged_prefill_attention(*args),
                               paged_prefill_attention_ref(*args), **TOL)


def test_write_kv_writes_both_and_skips_negative_slots():
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache = _cache(6, 4, 2, 64, gen)
    # k/v as strided views out of one fused projection, as the model makes them.
    qkv = torch.randn(5, 3 * 128, generator=gen).to(DEV)
    k = qkv[:, 128:256].view(5, 2, 64)
    v = qkv[:, 256:].view(5, 2, 64)
    slots = torch.tensor([0, 7, -1, 23, 9], device=DEV)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    write_kv_ref(k, v, ref_k, ref_v, slots)
    write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_pack_unpack_round_trip(dtype):
    gen = torch.Generator().manual_seed(2)
    k_cache, v_cache = _cache(10, 16, 2, 64, gen, dtype)  # 2,048 elements a block
    ids = torch.tensor([7, 2, 9, 3], device=DEV)
    packed = kv_pack(k_cache, v_cache, ids)
    assert torch.equal(packed, kv_pack_ref(k_cache, v_cache, ids))
    assert torch.equal(kv_pack(k_cache, v_cache, ids[:0]), kv_pack_ref(k_cache, v_cache, ids[:0]))
    dest = torch.tensor([0, 5, 1, 8], device=DEV)
    k2, v2 = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    rk, rv = k2.clone(), v2.clone()
    kv_unpack(packed, k2, v2, dest)
    kv_unpack_ref(packed, rk, rv, dest)
    assert torch.equal(k2, rk) and torch.equal(v2, rv)
    assert torch.equal(k2[5], k_cache[2]) and torch.equal(v2[8], v_cache[3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, with_residual):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(7, 96, generator=gen).to(DEV, dtype)  # 96: not a power of two
    w = torch.randn(96, generator=gen).to(DEV, dtype)
    res = torch.randn(7, 96, generator=gen).to(DEV, dtype) if with_residual else None
    out, new_res = rms_norm(x, w, 1e-5, res)
    ref, ref_res = rms_norm_ref(x, w, 1e-5, res)
    tol = TOL if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(out, ref, **tol)
    if with_residual:
        # The interpreter truncates float32 to bfloat16 where CUDA rounds to nearest.
        torch.testing.assert_close(new_res, ref_res, **tol)
    else:
        assert new_res is None


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("scaling", [None, RopeScaling(8.0, 1.0, 4.0, 64)])
def test_rotary_matches_reference(head_dim, scaling):
    gen = torch.Generator().manual_seed(5)
    inv = rope_inv_freq(head_dim, 500000.0, scaling).float()
    freqs = torch.outer(torch.arange(256, dtype=torch.float32), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(DEV), emb.sin().to(DEV)
    # q/k as strided views, GQA 4.
    qkv = torch.randn(9, 6 * head_dim, generator=gen).to(DEV)
    q = qkv[:, :4 * head_dim].view(9, 4, head_dim)
    k = qkv[:, 4 * head_dim:5 * head_dim].view(9, 1, head_dim)
    pos = torch.tensor([0, 1, 2, 17, 63, 64, 100, 200, 255], device=DEV)
    got = rotary_embedding(pos, q, k, cos, sin)
    want = rotary_embedding_ref(pos, q, k, cos, sin)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **TOL)


@pytest.mark.skipif(DEV == "cpu", reason="Triton's interpreter computes bfloat16 "
                    "tl.dot wrongly; checked on CUDA only")
def test_attention_kernels_in_bfloat16():
    gen = torch.Generator().manual_seed(6)
    k_cache, v_cache = _cache(12, 16, 2, 64, gen, torch.bfloat16)
    lens = [1, 33, 70]
    tables = _tables(lens, 16, 12, gen)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEV)
    q = torch.randn(3, 8, 64, generator=gen).to(DEV, torch.bfloat16)
    tol = {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(
        paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.125, split_len=32),
        paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, 0.125), **tol)
    qs = torch.tensor([0, 1, 9, 30], dtype=torch.int32, device=DEV)
    qp = torch.randn(30, 8, 64, generator=gen).to(DEV, torch.bfloat16)
    args = (qp, k_cache, v_cache, tables, qs, ctx, 21, 0.125)
    torch.testing.assert_close(paged_prefill_attention(*args),
                               paged_prefill_attention_ref(*args), **tol)
