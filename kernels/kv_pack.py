"""Gathering one layer's blocks of a request into a contiguous buffer, and back.

The buffer is ``[2 (K, V), n, block_size, KVH, D]`` for ``block_ids[0..n)``: the byte
layout the KV export uses (``services/engine/kv_cache.py``), so packing on the device
and one copy to host memory replaces a per-block gather.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 1024  # elements per program


def kv_pack_ref(k_cache, v_cache, block_ids):
    """``[2, n, block_size, KVH, D]`` copy of ``block_ids`` of one layer's caches."""
    ids = block_ids.long()
    return torch.stack([k_cache.index_select(0, ids), v_cache.index_select(0, ids)])


def kv_unpack_ref(buffer, k_cache, v_cache, block_ids):
    """Write a :func:`kv_pack_ref` buffer into ``block_ids`` of the caches, in place."""
    ids = block_ids.long()
    k_cache.index_copy_(0, ids, buffer[0])
    v_cache.index_copy_(0, ids, buffer[1])


@triton.jit
def _kv_pack_kernel(KC, VC, IDS, BUF, n, block_elems, CHUNK: tl.constexpr,
                    UNPACK: tl.constexpr):
    i = tl.program_id(0)
    kv = tl.program_id(1)
    c = tl.program_id(2)
    blk = tl.load(IDS + i).to(tl.int64)
    off = c * CHUNK + tl.arange(0, CHUNK)
    m = off < block_elems
    cache_off = blk * block_elems + off
    buf = BUF + (kv * n + i).to(tl.int64) * block_elems + off
    if kv == 0:
        if UNPACK:
            tl.store(KC + cache_off, tl.load(buf, mask=m), mask=m)
        else:
            tl.store(buf, tl.load(KC + cache_off, mask=m), mask=m)
    else:
        if UNPACK:
            tl.store(VC + cache_off, tl.load(buf, mask=m), mask=m)
        else:
            tl.store(buf, tl.load(VC + cache_off, mask=m), mask=m)


def _launch(k_cache, v_cache, block_ids, buffer, unpack: bool) -> None:
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and buffer.is_contiguous()):
        raise ValueError("KV pack/unpack needs contiguous caches and buffer")
    n = block_ids.numel()
    if n == 0:
        return
    block_elems = k_cache[0].numel()
    _kv_pack_kernel[(n, 2, -(-block_elems // CHUNK))](
        k_cache, v_cache, block_ids, buffer, n, block_elems, CHUNK=CHUNK, UNPACK=unpack)


def kv_pack(k_cache, v_cache, block_ids):
    """The Triton kernel behind :func:`kv_pack_ref` (same arguments)."""
    out = torch.empty((2, block_ids.numel(), *k_cache.shape[1:]), dtype=k_cache.dtype,
                      device=k_cache.device)
    _launch(k_cache, v_cache, block_ids, out, unpack=False)
    return out


def kv_unpack(buffer, k_cache, v_cache, block_ids):
    """The Triton kernel behind :func:`kv_unpack_ref` (same arguments)."""
    expected = (2, block_ids.numel(), *k_cache.shape[1:])
    if tuple(buffer.shape) != expected or buffer.dtype != k_cache.dtype:
        raise ValueError(f"KV buffer must be {expected} {k_cache.dtype}, "
                         f"got {tuple(buffer.shape)} {buffer.dtype}")
    _launch(k_cache, v_cache, block_ids, buffer.to(k_cache.device).contiguous(), unpack=True)
