"""Decode attention on the CPU without gathering each sequence's context into a copy.

A decode step attends one query per sequence to that sequence's whole cached context.
Gathering every context into a padded ``[seqs, context, kv_heads, head_dim]`` tensor
first writes the step's entire KV working set out to memory and reads it back (at
batch 64 that copy was most of attention's time, docs/benchmarks.md). Here the whole
decode batch walks the block tables a few blocks at a time instead: each chunk's K/V is
gathered into a buffer small enough to stay in cache, attended at once for every
sequence still inside its context, and the partial results are merged with their
log-sum-exp (the online softmax), so no step ever holds more than one chunk of keys.

Sequences are ordered by context length once per step, so the sequences a chunk
still covers are always a tail of the batch: a slice, not a copy, and no work on
sequences whose context has already ended.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.kv_int8 import widen

# Tokens per chunk: 64 tokens of K and V for 64 sequences (3 KV heads of 64 in float32)
# are ~3 MB, which stays in this class of CPU's L2/L3 between the gather and the matmuls.
CHUNK_TOKENS = 64
# The batch size CHUNK_TOKENS is sized for: a smaller batch takes chunks longer in
# proportion (same bytes per chunk), so a lone sequence attends its whole context in one
# fused call instead of paying a gather, a kernel call and a merge per 64 tokens.
CHUNK_ROWS = 64

_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


@dataclass(frozen=True, slots=True)
class Chunk:
    first: int  # first row (in context order) whose context reaches into this chunk
    num_blocks: int
    blocks: torch.Tensor  # [(rows - first) * num_blocks] long: the cache blocks to read
    mask: torch.Tensor | None  # [rows - first, 1, 1, tokens] additive, None if all valid


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """One step's decode batch in context order, cut into chunks; shared by all layers."""

    rows: slice | torch.Tensor  # the batch's decode tokens, shortest context first
    num_rows: int
    chunks: tuple[Chunk, ...]


def plan_decodes(groups: Sequence, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> DecodePlan | None:
    """Merge a step's ``DecodeGroup``s (``AttentionMetadata.decode_groups``; not imported,
    attention.py imports this module) into one :class:`DecodePlan` (None: no decodes)."""
    if not groups:
        return None
    rows: list[int] = []
    lens: list[int] = []
    width = max(g.block_tables.shape[1] for g in groups)
    tables = []
    for g in groups:
        rows.extend(range(g.start, g.start + g.size))
        lens.extend(g.context_lens.tolist())
        pad = width - g.block_tables.shape[1]
        tables.append(torch.nn.functional.pad(g.block_tables, (0, pad)) if pad else g.block_tables)
    table = torch.cat(tables) if len(tables) > 1 else tables[0]
    order = sorted(range(len(rows)), key=lens.__getitem__)
    if order != list(range(len(rows))):
        table = table[torch.tensor(order, device=table.device)]
        rows = [rows[i] for i in order]
        lens = [lens[i] for i in order]
    n = len(rows)
    contiguous = rows == list(range(rows[0], rows[0] + n))
    row_sel = (slice(rows[0], rows[0] + n) if contiguous
               else torch.tensor(rows, dtype=torch.long, device=device))
    lens_t = torch.tensor(lens, dtype=torch.long, device=device)
    step = max(1, CHUNK_TOKENS * max(1, CHUNK_ROWS // n) // block_size)
    chunks = []
    for b0 in range(0, -(-lens[-1] // block_size), step):
        first = bisect.bisect_right(lens, b0 * block_size)  # contexts that reach past b0
        b1 = min(b0 + step, table.shape[1])
        mask = None
        if lens[first] < b1 * block_size:
            pos = torch.arange(b0 * block_size, b1 * block_size, device=device)
            valid = pos[None, :] < lens_t[first:, None]
            mask = torch.zeros(valid.shape, dtype=dtype, device=device).masked_fill_(
                ~valid, float("-inf"))[:, None, None, :]
        chunks.append(Chunk(first, b1 - b0, table[first:, b0:b1].reshape(-1).contiguous(),
                            mask))
    return DecodePlan(row_sel, n, tuple(chunks))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     plan: DecodePlan) -> torch.Tensor:
    """Attention of the plan's decode queries (``q`` is the step's ``[T, heads, dim]``);
    returns ``[num_rows, heads, dim]`` in context order (``plan.rows``)."""
    _, block_size, num_kv_heads, row = k_cache.shape
    num_heads, head_dim = q.shape[1], q.shape[2]
    n = plan.num_rows
    # Query heads sharing a KV head become that head's query rows: [n, kv, rep, d].
    qg = q[plan.rows].view(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
    acc = lse = None
    for c in plan.chunks:
        m = n - c.first
        shape = (m, c.num_blocks * block_size, num_kv_heads, row)
        # A bfloat16 or int8 cache's chunk widened to the queries' float32 (in cache).
        keys = widen(k_cache.index_select(0, c.blocks).view(shape), q.dtype).transpose(1, 2)
        values = widen(v_cache.index_select(0, c.blocks).view(shape), q.dtype).transpose(1, 2)
        out, out_lse = attend(qg[c.first:], keys, values, c.mask)
        if acc is None:  # the first chunk covers every row: every context has a token
            acc, lse = out, out_lse.unsqueeze(-1)
            continue
        _merge(acc[c.first:], lse[c.first:], out, out_lse.unsqueeze(-1))
    return acc.reshape(n, num_heads, head_dim)


def attend(q, keys, values, mask, *, use_flash: bool = True):
    """Softmax attention of ``q`` ``[b, h, r, d]`` over ``keys``/``values`` ``[b, h, c, d]``
    with an additive ``mask``; returns the output and each row's log-sum-exp ``[b, h, r]``.

    torch's fused CPU kernel computes both in one pass; where this torch lacks it the
    same figures come from plain matmuls.
    """
    if use_flash and _FLASH is not None:
        out, lse = _FLASH(q, keys, values, 0.0, False, attn_mask=mask)[:2]
        return out, lse
    scores = torch.matmul(q, keys.transpose(-1, -2)).mul_(q.shape[-1] ** -0.5)
    if mask is not None:
        scores += mask
    lse = torch.logsumexp(scores.float() if scores.dtype.itemsize < 4 else scores, -1)
    probs = torch.exp(scores - lse.unsqueeze(-1).to(scores.dtype))
    return torch.matmul(probs, values), lse


def _merge(acc: torch.Tensor, lse: torch.Tensor, out: torch.Tensor,
           out_lse: torch.Tensor) -> None:
    """Fold a chunk's normalized ``out`` into ``acc`` in place, weighting each side by
    its share of the combined softmax mass; ``lse`` becomes the combined log-sum-exp."""
    top = torch.maximum(lse, out_lse)
    w_old = (lse - top).exp_()
    w_new = (out_lse - top).exp_()
    total = w_old + w_new
    acc.mul_(w_old.div_(total).to(acc.dtype)).add_(out * w_new.div_(total).to(out.dtype))
    lse.copy_(top.add_(total.log_()))
