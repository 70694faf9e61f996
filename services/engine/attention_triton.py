"""Paged attention with the Triton kernels (``kernels/``): the CUDA path.

Per layer: one launch writes the step's K and V into their slots, one attends every
decode (flash-decoding over the block tables, no gathered copy) and one attends every
prefill chunk (varlen, causal over its cached prefix and itself). The merged block
tables those launches need are built once per step, on the first layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.decode_attention import paged_decode_attention
from kernels.kv_write import write_kv
from kernels.prefill_attention import paged_prefill_attention
from kernels.rms_norm import rms_norm
from kernels.rotary import rotary_embedding
from services.engine.attention import AttentionBackend, AttentionMetadata


@dataclass(frozen=True, slots=True)
class _Batch:
    num_decodes: int
    decode_tables: torch.Tensor | None  # [decodes, width] long
    decode_lens: torch.Tensor | None  # [decodes]
    max_decode_len: int  # known on the host: the kernel needs no read-back
    prefill_start: int  # first prefill token in the flat batch
    prefill_end: int
    prefill_tables: torch.Tensor | None  # [segments, width] long
    query_start: torch.Tensor | None  # [segments + 1], relative to prefill_start
    context_lens: torch.Tensor | None  # [segments]
    max_query_len: int


def _stack_padded(tables: list[torch.Tensor]) -> torch.Tensor:
    """Rows (1-D or 2-D) padded with block 0 to one width; padding is never read."""
    rows = [t if t.dim() == 2 else t.unsqueeze(0) for t in tables]
    width = max(1, max(r.shape[1] for r in rows))
    return torch.cat([F.pad(r, (0, width - r.shape[1])) for r in rows])


def _prepare(meta: AttentionMetadata) -> _Batch:
    groups, segs = meta.decode_groups, meta.prefills
    num_decodes = sum(g.size for g in groups)
    if any(g.start != s for g, s in zip(groups, [0] + [g.start + g.size for g in groups],
                                        strict=False)):
        raise ValueError("decode groups must be contiguous from the first token")
    dec_tables = _stack_padded([g.block_tables for g in groups]) if groups else None
    dec_lens = torch.cat([g.context_lens for g in groups]) if groups else None
    max_dec = max((g.max_context_len for g in groups), default=0)
    if not segs:
        return _Batch(num_decodes, dec_tables, dec_lens, max_dec, 0, 0, None, None, None, 0)
    device = segs[0].block_table.device
    start = segs[0].start
    offsets = [0]
    for seg in segs:
        if seg.start != start + offsets[-1]:
            raise ValueError("prefill segments must be contiguous in the flat batch")
        offsets.append(offsets[-1] + seg.query_len)
    return _Batch(
        num_decodes, dec_tables, dec_lens, max_dec, start, start + offsets[-1],
        _stack_padded([s.block_table for s in segs]),
        torch.tensor(offsets, dtype=torch.int32, device=device),
        torch.tensor([s.context_len for s in segs], dtype=torch.int32, device=device),
        max(s.query_len for s in segs))


class TritonOps:
    """``LayerOps`` on the kernels: one launch per norm (residual add included) and one
    for rotary on q and k together."""

    def rms_norm(self, x, weight, eps, residual=None):
        return rms_norm(x, weight, eps, residual)

    def rotary(self, positions, q, k, cos, sin):
        return rotary_embedding(positions, q, k, cos, sin)


TRITON_OPS = TritonOps()


class TritonAttention(AttentionBackend):
    """The Triton kernels behind the same contract as ``TorchAttention``."""

    ops = TRITON_OPS
    capturable = True

    def forward(self, q, k, v, k_cache, v_cache, meta):
        if not isinstance(meta.prepared, _Batch):
            meta.prepared = _prepare(meta)
        batch: _Batch = meta.prepared
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        scale = q.shape[-1] ** -0.5
        if batch.num_decodes:
            n = batch.num_decodes
            out[:n] = paged_decode_attention(q[:n], k_cache, v_cache, batch.decode_tables,
                                             batch.decode_lens, scale,
                                             max_context_len=batch.max_decode_len)
        if batch.prefill_end > batch.prefill_start:
            sl = slice(batch.prefill_start, batch.prefill_end)
            out[sl] = paged_prefill_attention(
                q[sl], k_cache, v_cache, batch.prefill_tables, batch.query_start,
                batch.context_lens, batch.max_query_len, scale)
        return out
