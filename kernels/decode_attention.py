"""Paged decode attention: one query per sequence over its block table.

Flash-decoding: each (sequence, KV head) program pair walks one split of the context
straight out of the paged cache (no gathered copy), keeping a running max and sum; a
second kernel merges the splits by their log-sum-exp. Long contexts get more splits so
that a small batch still fills the GPU. All query heads that share a KV head (GQA) are
one tile, so each K/V element is read once per sequence.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import dot_precision, pow2

BLOCK_N = 32  # context tokens per inner step
MAX_SPLITS = 16
MIN_SPLIT_LEN = 256  # below this a split costs more to merge than it saves


def paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale,
                               split_len=None):
    """``q`` ``[B, H, D]`` against ``k_cache``/``v_cache`` ``[blocks, block_size, KVH, D]``;
    sequence b holds ``context_lens[b]`` tokens in ``block_tables[b]``. Returns
    ``[B, H, D]``. ``split_len`` only matters to the kernel."""
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kvh
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        pos = torch.arange(int(context_lens[b]), device=q.device)
        blocks = block_tables[b].long()[pos // bs]
        keys = k_cache[blocks, pos % bs].float().repeat_interleave(group, dim=1)
        values = v_cache[blocks, pos % bs].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), keys) * scale
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(-1), values).to(q.dtype)
    return out


@triton.jit
def _decode_split_kernel(Q, K, V, BT, CL, OP, LSE, scale, split_len,
                         sq_b, sq_h, sk_n, sk_t, sk_h, sbt_b, so_b, so_h, so_s, sl_b, sl_h,
                         PAGE: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
                         HEAD_DIM: tl.constexpr, D_P: tl.constexpr, BLOCK_N: tl.constexpr,
                         PREC: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(CL + b)
    start = split * split_len
    end = tl.minimum(start + split_len, ctx)
    g = tl.arange(0, GROUP_P)
    d = tl.arange(0, D_P)
    heads = kvh * GROUP + g
    gmask = g < GROUP
    dmask = d < HEAD_DIM
    q = tl.load(Q + b * sq_b + heads[:, None] * sq_h + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    m = tl.full([GROUP_P], float("-inf"), tl.float32)
    l_sum = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, D_P], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        tmask = t < end
        blk = tl.load(BT + b * sbt_b + t // PAGE, mask=tmask, other=0).to(tl.int64)
        off = blk * sk_n + (t % PAGE) * sk_t + kvh * sk_h
        kvmask = tmask[:, None] & dmask[None, :]
        k = tl.load(K + off[:, None] + d[None, :], mask=kvmask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC).to(tl.float32) * scale
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        v = tl.load(V + off[:, None] + d[None, :], mask=kvmask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m = m_new
    nonempty = l_sum > 0
    acc = acc / tl.where(nonempty, l_sum, 1.0)[:, None]
    lse = tl.where(nonempty, m + tl.log(tl.where(nonempty, l_sum, 1.0)), float("-inf"))
    tl.store(OP + b * so_b + heads[:, None] * so_h + split * so_s + d[None, :], acc,
             mask=gmask[:, None] & dmask[None, :])
    tl.store(LSE + b * sl_b + heads * sl_h + split, lse, mask=gmask)


@triton.jit
def _decode_reduce_kernel(OP, LSE, O, num_splits, so_b, so_h, so_s, sl_b, sl_h, sout_b, sout_h,
                          HEAD_DIM: tl.constexpr, D_P: tl.constexpr, S_P: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, S_P)
    d = tl.arange(0, D_P)
    smask = s < num_splits
    dmask = d < HEAD_DIM
    lse = tl.load(LSE + b * sl_b + h * sl_h + s, mask=smask, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # an empty context: all weights 0
    w = tl.exp(lse - top)
    part = tl.load(OP + b * so_b + h * so_h + s[:, None] * so_s + d[None, :],
                   mask=smask[:, None] & dmask[None, :], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * part, 0) / tl.where(total > 0, total, 1.0)
    tl.store(O + b * sout_b + h * sout_h + d, out.to(O.dtype.element_ty), mask=dmask)


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                           split_len=None, max_context_len=None):
    """The Triton kernel behind :func:`paged_decode_attention_ref` (same arguments).
    ``split_len`` (tokens per split) defaults to a size that gives long contexts up to
    ``MAX_SPLITS`` splits. ``max_context_len`` (>= every context length), when the
    caller knows it, spares reading it back from the device: no host sync, so the
    launch can be captured in a CUDA graph."""
    batch, num_heads, head_dim = q.shape
    page, kvh = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    if batch == 0:
        return out
    if k_cache.stride(3) != 1 or q.stride(2) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("decode attention needs head_dim-contiguous q and caches")
    max_ctx = int(context_lens.max()) if max_context_len is None else max_context_len
    if split_len is None:
        split_len = max(MIN_SPLIT_LEN, -(-max_ctx // MAX_SPLITS))
    split_len = -(-max(split_len, 1) // BLOCK_N) * BLOCK_N
    num_splits = max(1, -(-max_ctx // split_len))
    partial = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32,
                          device=q.device)
    lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    group = num_heads // kvh
    d_p = pow2(head_dim, 16)
    _decode_split_kernel[(batch, kvh, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, partial, lse, scale, split_len,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), partial.stride(0), partial.stride(1), partial.stride(2),
        lse.stride(0), lse.stride(1),
        PAGE=page, GROUP=group, GROUP_P=pow2(group, 16), HEAD_DIM=head_dim, D_P=d_p,
        BLOCK_N=BLOCK_N, PREC=dot_precision(q.dtype))
    _decode_reduce_kernel[(batch, num_heads)](
        partial, lse, out, num_splits, partial.stride(0), partial.stride(1), partial.stride(2),
        lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, D_P=d_p, S_P=pow2(num_splits, 2))
    return out
