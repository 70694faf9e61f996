"""Fused RMSNorm, optionally adding the residual first (one read, two writes).

Matches the model's ``RMSNorm``: half types are normalised in float32 and cast back
before the weight multiplies.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import pow2


def rms_norm_ref(x, weight, eps, residual=None):
    """``x`` ``[T, N]``. Returns ``(normed, x + residual)``, or ``(normed, None)`` with
    no residual."""
    if residual is not None:
        x = x + residual
        residual = x
    x32 = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype), residual


@triton.jit
def _rms_norm_kernel(X, R, W, O, RO, eps, sx, sr, so, sro, n,
                     N_P: tl.constexpr, HAS_RES: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, N_P)
    m = c < n
    # Arithmetic in float32, rounded where torch rounds (after the add, before the
    # weight): exact products of two half values round the same way, and Triton's
    # interpreter computes half-type arithmetic wrongly.
    x32 = tl.load(X + t * sx + c, mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        x = (x32 + tl.load(R + t * sr + c, mask=m, other=0.0).to(tl.float32))
        x = x.to(X.dtype.element_ty)
        tl.store(RO + t * sro + c, x, mask=m)
        x32 = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / n + eps)
    y = (x32 * inv).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + c, mask=m, other=0.0).to(tl.float32)
    tl.store(O + t * so + c, (w * y).to(O.dtype.element_ty), mask=m)


def rms_norm(x, weight, eps, residual=None):
    """The Triton kernel behind :func:`rms_norm_ref` (same arguments)."""
    if x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        raise ValueError("rms_norm needs rows contiguous in memory")
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else None
    if x.shape[0]:
        r = residual if residual is not None else x
        ro = res_out if res_out is not None else out
        _rms_norm_kernel[(x.shape[0],)](
            x, r, weight, out, ro, eps, x.stride(0), r.stride(0), out.stride(0),
            ro.stride(0), x.shape[1], N_P=pow2(x.shape[1]), HAS_RES=residual is not None)
    return out, res_out
