"""The per-layer ops an attention backend brings besides attention: RMSNorm (with the
residual add fused in) and rotary embedding.

``TORCH_OPS`` here is the CPU path and the reference; ``attention_triton.TRITON_OPS``
runs the same contract on the kernels in ``kernels/rms_norm.py`` and
``kernels/rotary.py``. The model calls whichever its backend carries
(``AttentionBackend.ops``).
"""

from __future__ import annotations

from typing import Protocol

import torch

from kernels import cpu_norm_rope

_HALF = (torch.float16, torch.bfloat16)


class LayerOps(Protocol):
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x`` ``[T, N]``. With ``residual``: ``s = x + residual`` (rounded to the
        dtype), returns ``(norm(s), s)``; without: ``(norm(x), None)``. Half types are
        normalised in float32 and cast back before the weight multiplies."""
        ...

    def rotary(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q`` ``[T, H, D]`` and ``k`` ``[T, KVH, D]`` rotated to ``positions``
        (half-split layout). ``cos``/``sin`` are float32 ``[positions, D]`` tables; half
        types rotate in float32 and round once."""
        ...


class TorchOps:
    """Plain torch: what the model computed before backends brought ops. With ``fused``
    (the default), float32 CPU tensors take the compiled one-call norm and rotary of
    ``kernels/cpu_norm_rope.py`` once built (same results to float32 rounding);
    ``REFERENCE_OPS`` never does."""

    def __init__(self, fused: bool = True) -> None:
        self.fused = fused

    def rms_norm(self, x, weight, eps, residual=None):
        if self.fused and cpu_norm_rope.takes_norm(x, weight, residual):
            return cpu_norm_rope.rms_norm(x, weight, eps, residual), residual
        if residual is not None:
            # The residual stream is the forward's own tensor: add into it in place.
            x = residual.add_(x)
            residual = x
        dtype = x.dtype
        x32 = x.float() if dtype in _HALF else x
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(dtype), residual

    def rotary(self, positions, q, k, cos, sin):
        if self.fused and cpu_norm_rope.takes_rotary(positions, q, k, cos):
            cpu_norm_rope.rotary_(positions, q, k, cos, sin)  # in place: q/k are the
            return q, k  # step's own projections
        dtype = q.dtype
        work = torch.float32 if dtype in _HALF else dtype
        c = cos[positions].unsqueeze(1).to(work)
        s = sin[positions].unsqueeze(1).to(work)
        return _rotate(q.to(work), c, s).to(dtype), _rotate(k.to(work), c, s).to(dtype)


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


TORCH_OPS = TorchOps()
REFERENCE_OPS = TorchOps(fused=False)
