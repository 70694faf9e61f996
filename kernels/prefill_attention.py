"""Paged prefill attention over a varlen batch: many sequences, one launch.

Sequence s contributes tokens ``query_start[s] .. query_start[s+1]`` of the flat batch;
they are its newest tokens, so with ``context_lens[s]`` tokens in the cache (the chunk's
own K/V included, written first) query i sits at position
``context_lens[s] - query_len + i`` and attends causally to every cached position up to
its own. Keys and values are read straight from the paged cache through the block table,
whatever the length of the cached prefix.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import dot_precision, pow2

BLOCK_M = 16  # queries per program
BLOCK_N = 32  # keys per inner step


def paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, query_start, context_lens,
                                max_query_len, scale):
    """``q`` ``[T, H, D]``; ``block_tables`` ``[S, W]``, ``query_start`` ``[S + 1]``,
    ``context_lens`` ``[S]``. Returns ``[T, H, D]`` (rows of no segment are zero)."""
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kvh
    out = torch.zeros_like(q)
    for s in range(block_tables.shape[0]):
        lo, hi = int(query_start[s]), int(query_start[s + 1])
        if hi == lo:
            continue
        ctx = int(context_lens[s])
        pos = torch.arange(ctx, device=q.device)
        blocks = block_tables[s].long()[pos // bs]
        keys = k_cache[blocks, pos % bs].float().repeat_interleave(group, dim=1)
        values = v_cache[blocks, pos % bs].float().repeat_interleave(group, dim=1)
        q_pos = torch.arange(ctx - (hi - lo), ctx, device=q.device)
        scores = torch.einsum("qhd,khd->hqk", q[lo:hi].float(), keys) * scale
        scores = scores.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[lo:hi] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(q.dtype)
    return out


@triton.jit
def _prefill_kernel(Q, K, V, O, BT, QS, CL, scale,
                    sq_t, sq_h, so_t, so_h, sk_n, sk_t, sk_h, sbt_s,
                    PAGE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                    D_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    PREC: tl.constexpr):
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    h = tl.program_id(2)
    q_start = tl.load(QS + seq)
    q_len = tl.load(QS + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    ctx = tl.load(CL + seq)
    prefix = ctx - q_len
    i = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    imask = i < q_len
    d = tl.arange(0, D_P)
    dmask = d < HEAD_DIM
    rows = (q_start + i).to(tl.int64)
    q = tl.load(Q + rows[:, None] * sq_t + h * sq_h + d[None, :],
                mask=imask[:, None] & dmask[None, :], other=0.0)
    q_pos = prefix + i
    kvh = h // GROUP
    # Keys past the tile's last query are masked for every row: stop there.
    kv_end = tl.minimum(ctx, prefix + (tile + 1) * BLOCK_M)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_P], tl.float32)
    for t0 in range(0, kv_end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        tmask = t < kv_end
        blk = tl.load(BT + seq * sbt_s + t // PAGE, mask=tmask, other=0).to(tl.int64)
        off = blk * sk_n + (t % PAGE) * sk_t + kvh * sk_h
        kvmask = tmask[:, None] & dmask[None, :]
        k = tl.load(K + off[:, None] + d[None, :], mask=kvmask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC).to(tl.float32) * scale
        # Key 0 is visible to every row, so no row is all -inf after the first step.
        s = tl.where((t[None, :] <= q_pos[:, None]) & tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        v = tl.load(V + off[:, None] + d[None, :], mask=kvmask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m = m_new
    acc = acc / l_sum[:, None]
    tl.store(O + rows[:, None] * so_t + h * so_h + d[None, :], acc.to(O.dtype.element_ty),
             mask=imask[:, None] & dmask[None, :])


def paged_prefill_attention(q, k_cache, v_cache, block_tables, query_start, context_lens,
                            max_query_len, scale):
    """The Triton kernel behind :func:`paged_prefill_attention_ref` (same arguments)."""
    num_tokens, num_heads, head_dim = q.shape
    page, kvh = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros_like(q)
    num_seqs = block_tables.shape[0]
    if num_tokens == 0 or num_seqs == 0 or max_query_len == 0:
        return out
    if k_cache.stride(3) != 1 or q.stride(2) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("prefill attention needs head_dim-contiguous q and caches")
    grid = (num_seqs, -(-max_query_len // BLOCK_M), num_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, query_start, context_lens, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        PAGE=page, GROUP=num_heads // kvh, HEAD_DIM=head_dim, D_P=pow2(head_dim, 16),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, PREC=dot_precision(q.dtype))
    return out
