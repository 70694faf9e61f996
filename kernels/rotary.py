"""Rotary position embedding on q and k in one kernel, half-split layout.

The frequencies (Llama 3 scaling included) are the caller's: ``cos``/``sin`` are
``[max_positions, head_dim]`` tables as the model builds them from its inverse
frequencies, both halves equal.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import pow2


def rotary_embedding_ref(positions, q, k, cos, sin):
    """``q`` ``[T, H, D]`` and ``k`` ``[T, KVH, D]`` rotated to ``positions``; new tensors.
    Half types rotate in float32 against float32 tables and round once."""
    work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    c = cos[positions].unsqueeze(1).to(work)
    s = sin[positions].unsqueeze(1).to(work)

    def rotate(x):
        x = x.to(work)
        half = x.shape[-1] // 2
        return (x * c + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * s).to(q.dtype)

    return rotate(q), rotate(k)


@triton.jit
def _rotate_heads(X, O, sx_t, sx_h, so_t, so_h, t, cos, sin, nh,
                  HALF: tl.constexpr, H_P: tl.constexpr, HALF_P: tl.constexpr):
    h = tl.arange(0, H_P)
    j = tl.arange(0, HALF_P)
    m = (h[:, None] < nh) & (j[None, :] < HALF)
    base = X + t * sx_t + h[:, None] * sx_h + j[None, :]
    x1 = tl.load(base, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=m, other=0.0).to(tl.float32)
    out = O + t * so_t + h[:, None] * so_h + j[None, :]
    tl.store(out, (x1 * cos[None, :] - x2 * sin[None, :]).to(O.dtype.element_ty), mask=m)
    tl.store(out + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(O.dtype.element_ty),
             mask=m)


@triton.jit
def _rotary_kernel(P, Q, K, QO, KO, COS, SIN, sq_t, sq_h, sk_t, sk_h, sqo_t, sqo_h, sko_t,
                   sko_h, sc, nq, nk, HALF: tl.constexpr, HALF_P: tl.constexpr,
                   HQ_P: tl.constexpr, HK_P: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(P + t).to(tl.int64)
    j = tl.arange(0, HALF_P)
    cos = tl.load(COS + pos * sc + j, mask=j < HALF, other=0.0).to(tl.float32)
    sin = tl.load(SIN + pos * sc + j, mask=j < HALF, other=0.0).to(tl.float32)
    _rotate_heads(Q, QO, sq_t, sq_h, sqo_t, sqo_h, t, cos, sin, nq, HALF, HQ_P, HALF_P)
    _rotate_heads(K, KO, sk_t, sk_h, sko_t, sko_h, t, cos, sin, nk, HALF, HK_P, HALF_P)


def rotary_embedding(positions, q, k, cos, sin):
    """The Triton kernel behind :func:`rotary_embedding_ref` (same arguments)."""
    if q.stride(2) != 1 or k.stride(2) != 1 or cos.stride(1) != 1 or \
            cos.stride() != sin.stride():
        raise ValueError("rotary needs head_dim-contiguous q, k and tables")
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if q.shape[0]:
        half = q.shape[2] // 2
        _rotary_kernel[(q.shape[0],)](
            positions, q, k, q_out, k_out, cos, sin, q.stride(0), q.stride(1), k.stride(0),
            k.stride(1), q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
            cos.stride(0), q.shape[1], k.shape[1], HALF=half, HALF_P=pow2(half),
            HQ_P=pow2(q.shape[1]), HK_P=pow2(k.shape[1]))
    return q_out, k_out
