"""Attention over a paged KV cache.

One forward pass carries a flat batch of tokens from many sequences. They are laid out
with every single-token query first (decodes, batched together) and the multi-token
prefill chunks after, one segment per sequence::

    tokens:  d0 d1 d2 | p0 p0 p0 p0 | p1 p1
             decodes    prefill seg 0  prefill seg 1

Every token's K and V are written into the cache at ``slot_mapping`` (block id *
block size + offset) before attention reads it, so a chunk attends to its cached prefix
and to itself through the same paged path.

Backends implement :class:`AttentionBackend`; the torch one here runs anywhere, the
Triton one (``attention_triton.py``) on CUDA; ``attention_backends.py`` picks one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.kv_int8 import to_cache, widen
from services.engine import attention_paged_cpu
from services.engine.attention_decode import DecodePlan, decode_attention, plan_decodes
from services.engine.attention_ops import TORCH_OPS, LayerOps


@dataclass(slots=True)
class PrefillSegment:
    start: int  # first token of the segment in the flat batch
    query_len: int
    context_len: int  # tokens of this sequence in the cache after this step
    block_table: torch.Tensor  # [num_blocks] long


@dataclass(slots=True)
class DecodeGroup:
    """Single-token queries of similar context length, attended in one batched call."""

    start: int
    size: int
    block_tables: torch.Tensor  # [size, max_blocks] long, padded with block 0
    context_lens: torch.Tensor  # [size] long
    max_context_len: int


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] long
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillSegment]
    # What a backend derives from this step's metadata once, on its first layer, and
    # reuses for the others (the Triton backend's merged block tables).
    prepared: object = None


@dataclass(frozen=True, slots=True)
class PagedDecodes:
    """A step's decode groups as the compiled kernel's calls, built on the first layer and
    reused by the others: groups that follow one another in the batch (the model runner
    lays them out so) become one call with one ``[rows, width]`` table, so every layer
    makes one call whose threads split the whole batch by work, not one per group."""

    calls: tuple[tuple[int, int, torch.Tensor, torch.Tensor], ...]  # start, size, tables, lens
    # (tables, lens) where one call covers every token of the step (decodes only): each
    # layer then writes its K/V and attends in one native call (``write_decode``).
    whole: tuple[torch.Tensor, torch.Tensor] | None = None

    @staticmethod
    def of(groups: list[DecodeGroup], num_tokens: int = -1) -> PagedDecodes:
        runs: list[list[DecodeGroup]] = []
        for g in groups:
            if runs and runs[-1][-1].start + runs[-1][-1].size == g.start:
                runs[-1].append(g)
            else:
                runs.append([g])
        calls = []
        for run in runs:
            width = max(g.block_tables.shape[1] for g in run)
            tables = torch.cat([F.pad(g.block_tables, (0, width - g.block_tables.shape[1]))
                                for g in run]) if len(run) > 1 else run[0].block_tables
            lens = torch.cat([g.context_lens for g in run]) if len(run) > 1 else run[0].context_lens
            calls.append((run[0].start, sum(g.size for g in run), tables.contiguous(),
                          lens.contiguous()))
        whole = (calls[0][2], calls[0][3]) if (
            len(calls) == 1 and calls[0][:2] == (0, num_tokens)) else None
        return PagedDecodes(tuple(calls), whole)


class AttentionBackend(ABC):
    """Computes attention for one layer and writes that layer's new K/V into the cache.

    ``q`` is ``[T, num_heads, head_dim]``, ``k`` and ``v`` are ``[T, num_kv_heads,
    head_dim]`` for the T tokens of the batch; ``k_cache``/``v_cache`` are that layer's
    ``[num_blocks, block_size, num_kv_heads, head_dim]`` tensors. Returns ``[T,
    num_heads, head_dim]``. Query heads are grouped onto KV heads in order (GQA).
    ``ops`` are the norm and rotary the model runs with this backend.
    """

    ops: LayerOps = TORCH_OPS
    # Whether a decode step's launches can be captured in a CUDA graph (no host reads,
    # shapes fixed by the padded inputs).
    capturable: bool = False

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor: ...


class TorchAttention(AttentionBackend):
    """Paged attention in plain torch; the CPU path.

    ``decode="auto"`` reads the cache in place with the compiled kernel
    (``attention_paged_cpu.py``) once it is built (in the background) where it takes
    the layer, and walks the cache a chunk of blocks at a time in torch otherwise
    (``"chunked"``, ``attention_decode.py``); ``"paged"`` asks for the kernel only
    (waiting for its build); ``"gather"`` keeps the earliest path, which copies every
    context out of the cache first, for comparison (``bench/attention_cpu.py``).
    """

    def __init__(self, decode: str = "auto") -> None:
        if decode not in ("auto", "paged", "chunked", "gather"):
            raise ValueError(f"decode must be auto, paged, chunked or gather, got {decode!r}")
        if decode == "paged" and not attention_paged_cpu.available():
            raise ValueError("decode=paged needs the compiled CPU kernel, which did not build")
        self.decode = decode

    def forward(self, q, k, v, k_cache, v_cache, meta):
        prepared = meta.prepared
        # A step's first layer picks the path; the others, alike in dtype and shape, follow.
        if isinstance(prepared, PagedDecodes):
            decode = "paged"
        else:
            decode = self.decode
            if decode == "auto":
                decode = ("paged" if attention_paged_cpu.supports(q, k_cache)
                          and attention_paged_cpu.ready() else "chunked")
            if decode == "paged":
                prepared = meta.prepared = PagedDecodes.of(
                    meta.decode_groups, -1 if meta.prefills else q.shape[0])
        if decode == "paged" and prepared.whole is not None:
            return attention_paged_cpu.write_decode(q, k, v, k_cache, v_cache,
                                                    meta.slot_mapping, *prepared.whole)
        num_kv_heads, row = k_cache.shape[2], k_cache.shape[3]
        # A bfloat16 or int8 cache of a float32 model: K/V rounded or quantized as stored.
        k, v = to_cache(k, k_cache), to_cache(v, v_cache)
        k_cache.view(-1, num_kv_heads, row).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, num_kv_heads, row).index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        if decode == "paged":
            for start, size, tables, lens in prepared.calls:
                # q's rows are views into the fused QKV projection: the kernel reads them
                # where they are, no copy.
                attention_paged_cpu.paged_decode(q[start:start + size], k_cache, v_cache,
                                                 tables, lens, out[start:start + size])
        elif decode == "chunked":
            if not isinstance(meta.prepared, DecodePlan):
                meta.prepared = plan_decodes(meta.decode_groups, k_cache.shape[1], q.dtype,
                                             q.device)
            if meta.prepared is not None:
                out[meta.prepared.rows] = decode_attention(q, k_cache, v_cache, meta.prepared)
        else:
            for group in meta.decode_groups:
                sl = slice(group.start, group.start + group.size)
                out[sl] = _decode_attention(q[sl], k_cache, v_cache, group)
        for seg in meta.prefills:
            sl = slice(seg.start, seg.start + seg.query_len)
            if seg.context_len == seg.query_len:
                # Nothing cached before this chunk: attend to the fresh K/V directly (as
                # the cache holds them: rounded or quantized, so a prompt's answer does not
                # depend on whether its prefix was cached).
                keys, values = widen(k[sl], q.dtype), widen(v[sl], q.dtype)
            else:
                keys = widen(_gather(k_cache, seg.block_table, seg.context_len), q.dtype)
                values = widen(_gather(v_cache, seg.block_table, seg.context_len), q.dtype)
            out[sl] = _prefill_attention(q[sl], keys, values, seg.context_len)
        return out


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` cached tokens of one sequence: ``[length, kv_heads, row]``."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    blocks = cache.index_select(0, block_table[:num_blocks])
    return blocks.flatten(0, 1)[:length]


# Query rows per call in a fresh prompt's causal attention on the CPU: torch's fused CPU
# kernel skips masked work only in whole 512-key tiles, so a causal prompt of up to 512
# tokens cost as much as a full square; in bands of 64 queries, each against the keys up
# to its end, the work is ~half the square (prompts of 200-512 tokens: 25-35% less time).
CAUSAL_BAND = 64


def _prefill_attention(q, keys, values, context_len):
    """Causal attention of ``q_len`` queries placed at the end of ``context_len`` keys."""
    q_len = q.shape[0]
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, q, d]
    kh = keys.transpose(0, 1).unsqueeze(0)
    vh = values.transpose(0, 1).unsqueeze(0)
    gqa = qh.shape[1] != kh.shape[1]
    if context_len == q_len and q_len > 2 * CAUSAL_BAND and q.device.type == "cpu":
        return _banded_causal(qh, kh, vh, gqa).squeeze(0).transpose(0, 1)
    if context_len == q_len:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=gqa)
    else:
        q_pos = torch.arange(context_len - q_len, context_len, device=q.device)
        k_pos = torch.arange(context_len, device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=gqa)
    return o.squeeze(0).transpose(0, 1)


def _banded_causal(qh, kh, vh, gqa: bool) -> torch.Tensor:
    """Causal attention ``[1, H, L, d]``, ``CAUSAL_BAND`` queries at a time, each band
    against the keys up to its last query (module note at ``CAUSAL_BAND``)."""
    q_len = qh.shape[2]
    out = torch.empty_like(qh)
    band = CAUSAL_BAND
    out[:, :, :band] = F.scaled_dot_product_attention(
        qh[:, :, :band], kh[:, :, :band], vh[:, :, :band], is_causal=True, enable_gqa=gqa)
    causal = torch.ones(q_len, q_len, dtype=torch.bool, device=qh.device).tril_()
    for start in range(band, q_len, band):
        end = min(q_len, start + band)
        out[:, :, start:end] = F.scaled_dot_product_attention(
            qh[:, :, start:end], kh[:, :, :end], vh[:, :, :end],
            attn_mask=causal[start:end, :end], enable_gqa=gqa)
    return out


def _decode_attention(q, k_cache, v_cache, group: DecodeGroup):
    """One query per sequence against its whole cached context, batched with padding."""
    size, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    ctx = group.max_context_len
    nblk = (ctx + block_size - 1) // block_size
    tables = group.block_tables[:, :nblk]
    # [size, kv_heads, ctx, head_dim] views of the gathered blocks.
    shape = (size, nblk * block_size, num_kv_heads, k_cache.shape[3])
    keys = widen(k_cache[tables].view(shape)[:, :ctx], q.dtype)
    values = widen(v_cache[tables].view(shape)[:, :ctx], q.dtype)
    valid = torch.arange(ctx, device=q.device)[None, :] < group.context_lens[:, None]
    # Query heads sharing a KV head become that head's rows: [size, kv, rep, d].
    qg = q.view(size, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(qg, keys.transpose(1, 2), values.transpose(1, 2),
                                         attn_mask=valid[:, None, None, :])
    return out.reshape(size, num_heads, head_dim)
