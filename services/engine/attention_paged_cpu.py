"""Decode attention that reads the paged KV cache in place: a small C++ loop for the CPU.

Each sequence walks its own block table straight out of the
``[num_blocks, block_size, kv_heads, head_dim]`` cache and writes its heads' outputs
into the step's output tensor; nothing is gathered into a copy and no partial results
are merged: the K/V bytes of the step are read once, which is the floor for decode.
With AVX-512 (kernels/cpu_paged_decode.py holds the source) a sequence takes two passes
over its blocks: the first reads each block's K rows once and writes every query head's
scores into a per-thread row of scores (16 tokens at a time out of one shuffle tree);
then each head's softmax is one maximum, one vectorized ``exp`` and one sum over its
whole context (no running rescale: a decode query's scores are a few KB); the second
pass reads each block's V rows once for all query heads of a KV head, their
accumulators in registers. Each thread knows the blocks it will read in order and asks
for the one two places ahead into L2, a token row at a time, while it computes: the
kernel was bound by memory stalls, not arithmetic (docs/benchmarks.md, "Kernel v7").
Threads split the batch by context length.

Why a kernel of our own: torch has no gather-matmul, so every torch formulation either
copies each context out of the cache (``attention_decode.py``: a chunk at a time, then
merges the chunks) or computes against blocks it does not need; and torch's fused CPU
attention is tuned for long queries, not the 1-token queries of decode (at batch 64 it
ran at a fraction of memory bandwidth, docs/benchmarks.md). The loop here is built with
torch's extension loader (vectorized by the compiler for the host CPU), in a thread
(:func:`ready`); until it is built, where no compiler is at hand (one log line), or for
dtypes and shapes it does not take (float32 queries, ``head_dim`` a multiple of 16,
:func:`supports`), the caller keeps the torch path. Other CPUs and head sizes take a
portable loop with an online softmax.

The cache may be float32 or bfloat16 (``kv_cache_dtype``, EngineConfig): a second
instantiation of the same loops reads bfloat16 rows and widens each to float32 in
registers (a 16-bit shift, exact), so the arithmetic is the float32 kernel's over the
rounded values at half the bytes read; ``write_decode`` rounds new rows to the cache's
type as ``Tensor.to`` does (nearest, ties to even).

Where the CPU has AVX512_BF16 (the build targets it and the CPU says so at run time,
:func:`bf16_dot`), a bfloat16 cache takes bf16 dot products instead (v9,
kernels/cpu_bf16_dot.py): widening every element and multiplying in float was the
bound once K/V were in L1, and ``vdpbf16ps`` does 32 bf16 multiply-adds in one
instruction. Scores: q rounded to bfloat16 once per sequence and head, one accumulator
per token against its K row, 16 tokens summed across lanes at once. Values: the
probabilities rounded to bfloat16 (their float sum, of the rounded values, normalises),
V rows paired two tokens at a time (unpacklo/hi, shared by a KV head's query heads)
against the broadcast pair (p_t, p_t+1). So the output is attention with q and p
carrying 8 significant bits (tests/test_paged_kernel_bf16_dot.py: within 1e-3 of a
reference rounding the same way); ``widen=True`` keeps the exact path.

An int8 cache (v10, kernels/cpu_int8_dot.py) holds each (token, KV head) row as int8
values and its float32 scale (kernels/kv_int8.py): a quarter of float32's bytes plus 4 a
row, for a kernel that the bfloat16 cache left bound by its K/V reads. Where the CPU has
AVX512_VNNI (:func:`i8_dot`), scores are integer dot products: the query quantized the
same way per (sequence, head), ``vpdpbusd`` over K rows whose sign bit is flipped to make
them unsigned (k + 128; the 128 * sum(q) it adds is subtracted once per head), times the
two scales; values widen each V row to float once for its query heads, against the
probability times the row's scale. Elsewhere (``widen=True``, or another CPU) a portable
loop dequantizes each row as it reads it. ``write_decode`` quantizes new rows as
kernels/kv_int8.py's reference does, byte for byte.
"""

from __future__ import annotations

import torch

from kernels.cpu_build import CppKernel
from kernels.cpu_paged_decode import SOURCE
from kernels.kv_int8 import head_dim_of

_KERNEL = CppKernel("pdserve_paged_decode_v10", SOURCE,
                    "decode attention gathers K/V chunks in torch instead")


def available() -> bool:
    """Whether the compiled kernel is built (builds it on first call, waiting for it)."""
    return _KERNEL.available()


def ready() -> bool:
    """Whether it is built, without waiting (starts the build in a thread; the torch path
    decodes meanwhile)."""
    return _KERNEL.ready()


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether it takes this layer: float32 queries on the CPU over a contiguous float32,
    bfloat16 or int8 cache, ``head_dim`` % 16 == 0."""
    kv_heads, head_dim = k_cache.shape[2], head_dim_of(k_cache)
    return (q.device.type == "cpu" and q.dtype == torch.float32
            and k_cache.dtype in (torch.float32, torch.bfloat16, torch.int8)
            and k_cache.is_contiguous() and head_dim % 16 == 0 and head_dim == q.shape[2]
            and q.shape[1] % kv_heads == 0)


def bf16_dot() -> bool:
    """Whether the built kernel has the bfloat16 dot-product path (v9) and this CPU runs
    it (AVX512_BF16); builds the kernel, waiting, on first call."""
    mod = _KERNEL.module()
    return mod is not None and mod.has_bf16_dot()


def i8_dot() -> bool:
    """Whether the built kernel has the int8 dot-product path (v10) and this CPU runs it
    (AVX512_VNNI); builds the kernel, waiting, on first call."""
    mod = _KERNEL.module()
    return mod is not None and mod.has_i8_dot()


def _dot(mod, k_cache: torch.Tensor, widen: bool) -> bool:
    if widen:
        return False
    if k_cache.dtype == torch.int8:
        return mod.has_i8_dot()
    return k_cache.dtype == torch.bfloat16 and mod.has_bf16_dot()


def paged_decode(q, k_cache, v_cache, block_tables, context_lens, out, *,
                 widen: bool = False) -> None:
    """Write into ``out`` ``[n, heads, dim]`` the attention of ``q`` ``[n, heads, dim]``
    (one query per sequence) over each sequence's first ``context_lens[i]`` cached tokens,
    through ``block_tables`` ``[n, width]``; bad ids or lengths: ``RuntimeError``. A
    bfloat16 cache takes the dot-product path where :func:`bf16_dot` (q and the
    probabilities rounded to bfloat16), or with ``widen`` the widening one (exact); an
    int8 cache the integer one where :func:`i8_dot`, or with ``widen`` the portable
    dequantizing one."""
    mod = _KERNEL.module()
    mod.paged_decode(q, k_cache, v_cache, block_tables, context_lens, out,
                     q.shape[-1] ** -0.5, _dot(mod, k_cache, widen))


def write_decode(q, k, v, k_cache, v_cache, slots, tables, lens, *, widen: bool = False):
    """Decodes only: ``k``/``v`` ``[n, kv_heads, dim]`` written at ``slots`` ``[n]`` (as
    ``index_copy_``), then :func:`paged_decode` of ``q`` into a new tensor. A bad slot:
    ``RuntimeError``, nothing written; a bad block id or length: the same before any
    read (as ``index_copy_`` then :func:`paged_decode` did)."""
    mod = _KERNEL.module()
    return mod.write_decode(q, k, v, k_cache, v_cache, slots, tables, lens,
                            _dot(mod, k_cache, widen))
