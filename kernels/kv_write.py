"""Writing a step's new K and V into their cache slots, both in one kernel.

``slot_mapping[t]`` is ``block_id * block_size + offset`` for token t; a negative slot
means "no slot" (a padding token) and is skipped.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels._common import pow2


def write_kv_ref(k, v, k_cache, v_cache, slot_mapping):
    """``k``/``v`` ``[T, KVH, D]`` into ``k_cache``/``v_cache`` ``[blocks, block_size, KVH,
    D]`` in place."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k[keep])
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v[keep])


@triton.jit
def _write_kv_kernel(K, V, KC, VC, SLOT, sk_t, sv_t, sc_slot,
                     ROW: tl.constexpr, ROW_P: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(SLOT + t).to(tl.int64)
    if slot < 0:
        return
    r = tl.arange(0, ROW_P)
    m = r < ROW
    tl.store(KC + slot * sc_slot + r, tl.load(K + t * sk_t + r, mask=m), mask=m)
    tl.store(VC + slot * sc_slot + r, tl.load(V + t * sv_t + r, mask=m), mask=m)


def write_kv(k, v, k_cache, v_cache, slot_mapping):
    """The Triton kernel behind :func:`write_kv_ref` (same arguments)."""
    if k.shape[0] == 0:
        return
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("write_kv needs contiguous caches")
    row = k.shape[1] * k.shape[2]
    # A token's heads must be one run of memory; q/k/v split views already are.
    k = k if k.stride(2) == 1 and k.stride(1) == k.shape[2] else k.contiguous()
    v = v if v.stride(2) == 1 and v.stride(1) == v.shape[2] else v.contiguous()
    _write_kv_kernel[(k.shape[0],)](k, v, k_cache, v_cache, slot_mapping,
                                    k.stride(0), v.stride(0), row, ROW=row, ROW_P=pow2(row))
