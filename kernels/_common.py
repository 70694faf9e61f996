"""Small helpers the Triton kernels share (imports triton: load through the kernels only)."""

from __future__ import annotations

import torch
import triton


def pow2(n: int, floor: int = 1) -> int:
    """The next power of two >= max(n, floor): Triton tiles are powers of two."""
    return max(triton.next_power_of_2(max(n, 1)), floor)


def dot_precision(dtype: torch.dtype) -> str:
    """float32 tiles would drop to tf32 in ``tl.dot`` on CUDA: keep them exact, so that a
    float32 run matches the torch path; half types use the tensor cores as they are."""
    return "ieee" if dtype in (torch.float32, torch.float64) else "tf32"
