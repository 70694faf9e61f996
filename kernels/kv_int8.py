"""The int8 KV cache's row format, and its torch reference (quantize, dequantize).

``kv_cache_dtype="int8"`` (services/engine/config.py) keeps each (token, KV head) row of
K and V as ``head_dim`` int8 values followed by the row's float32 scale, its 4 bytes
little-endian, in an int8 cache tensor ``[..., kv_heads, head_dim + 4]``::

    row   | q_0 q_1 ... q_{D-1} | scale (float32, 4 bytes) |      x_d ~= q_d * scale

So every block stays self-contained bytes: exports, imports, the data plane's landing
views and the cache pool move int8 blocks by bytes as they move float blocks, with no
side table of scales to keep in step. Symmetric, per row: ``scale = max|x| / 127``,
``q = round(x / scale)`` (ties to even) in -127..127; a row of zeros has scale 0.

The compiled decode kernel's ``write_decode`` (kernels/cpu_int8_dot.py) quantizes the
same way, division and rounding alike, so its rows equal :func:`quantize_rows`' byte for
byte; the torch attention paths :func:`widen` what they gather to the model's dtype.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # a float32 scale after each row's int8 values


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one (token, KV head) row in a cache of ``dtype``."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def head_dim_of(cache: torch.Tensor) -> int:
    """The head size a cache ``[..., kv_heads, row]`` holds."""
    return cache.shape[-1] - SCALE_BYTES if cache.dtype == torch.int8 else cache.shape[-1]


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., D]`` (float) as int8 rows ``[..., D + 4]``: D values, then the scale."""
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True) / 127
    q = torch.round(x / torch.where(scale > 0, scale, 1.0)).clamp_(-127, 127).to(torch.int8)
    return torch.cat([q, scale.contiguous().view(torch.int8)], -1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Int8 rows ``[..., D + 4]`` back to ``[..., D]`` values of ``dtype``."""
    d = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float32)
    return (rows[..., :d].float() * scale).to(dtype)


def to_cache(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """``x`` as ``cache`` stores it: quantized rows, rounded, or as is."""
    if cache.dtype == torch.int8:
        return quantize_rows(x)
    return x if x.dtype == cache.dtype else x.to(cache.dtype)


def widen(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows (or a gather of them) as ``dtype`` values for attention."""
    if rows.dtype == torch.int8:
        return dequantize_rows(rows, dtype)
    return rows.to(dtype)
