"""Turns a scheduled step into tensors, runs the model, and returns logits to sample."""

from __future__ import annotations

import logging
from itertools import chain
from typing import NamedTuple

import msgpack
import torch

from kernels import cpu_layer
from services.engine.attention import AttentionMetadata, DecodeGroup, PrefillSegment
from services.engine.kv_cache import KVCache
from services.engine.model import LlamaModel
from services.engine.scheduler import ScheduledSeq
from services.engine.sequence import Sequence
from services.engine.weights.quantize import A8Linear

log = logging.getLogger(__name__)

# Decodes are attended in groups of similar context length so that padding each
# group to its longest member wastes little.
DECODE_GROUP_SIZE = 16


class StepInputs(NamedTuple):
    """A step's model inputs as plain integers: what rank 0 sends its tensor-parallel
    followers (``to_msgpack``), and what every rank turns into tensors."""

    ids: list[int]
    positions: list[int]
    slots: list[int]
    # (start, size, block tables [size][width], context lens [size], max context len)
    decode_groups: list[tuple[int, int, list[list[int]], list[int], int]]
    # (start, query len, context len, block table)
    prefills: list[tuple[int, int, int, list[int]]]
    logits_rows: list[int]

    def to_msgpack(self) -> bytes:
        return msgpack.packb(tuple(self), use_bin_type=True)

    @classmethod
    def from_msgpack(cls, data: bytes) -> StepInputs:
        return cls(*msgpack.unpackb(data, use_list=True, raw=False))


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: KVCache, device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.device = device
        self.graphs = None  # DecodeGraphs, for decode-only steps (services/engine/cuda_graphs)
        if model.fused_layers is None:
            model.fused_layers = FusedLayers.for_model(model, device)

    def run(self, batch: list[ScheduledSeq],
            layer_hook=None) -> tuple[torch.Tensor, list[Sequence]]:
        """Compute the scheduled tokens; return logits for each sequence that samples.

        A sequence samples when this step computes its last known token. Row i of the
        logits belongs to the i-th returned sequence.
        """
        inputs, sampling = self.prepare(batch)
        return self.forward(inputs, layer_hook), sampling

    def prepare(self, batch: list[ScheduledSeq]) -> tuple[StepInputs, list[Sequence]]:
        """The step's inputs, and the sequences that sample, in logits row order."""
        decodes = sorted((s for s in batch if s.num_new_tokens == 1),
                         key=lambda s: s.seq.num_computed_tokens)
        prefills = [s for s in batch if s.num_new_tokens > 1]
        bs = self.block_size
        inputs = StepInputs([], [], [], [], [], [])
        ids, positions, slots, logits_rows = (inputs.ids, inputs.positions, inputs.slots,
                                              inputs.logits_rows)
        sampling: list[Sequence] = []
        for g in range(0, len(decodes), DECODE_GROUP_SIZE):
            members = decodes[g:g + DECODE_GROUP_SIZE]
            ctx = [m.seq.num_computed_tokens + 1 for m in members]
            width = -(-max(ctx) // bs)
            tables = [m.seq.block_table[:width] + [0] * (width - len(m.seq.block_table[:width]))
                      for m in members]
            inputs.decode_groups.append((len(ids), len(members), tables, ctx, max(ctx)))
            for m in members:
                seq, pos = m.seq, m.seq.num_computed_tokens
                token = (seq.prompt_token_ids[pos] if pos < seq.num_prompt_tokens
                         else seq.output_token_ids[pos - seq.num_prompt_tokens])
                ids.append(token)
                positions.append(pos)
                slots.append(seq.block_table[pos // bs] * bs + pos % bs)
                if pos + 1 == seq.num_tokens:
                    sampling.append(seq)
                    logits_rows.append(len(ids) - 1)

        for seq, n in prefills:
            start = seq.num_computed_tokens
            end = start + n
            table = list(seq.block_table)
            inputs.prefills.append((len(ids), n, end, table))
            ids.extend(seq.token_ids()[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if end == seq.num_tokens:
                sampling.append(seq)
                logits_rows.append(len(ids) - 1)
        return inputs, sampling

    def forward(self, inputs: StepInputs, layer_hook=None) -> torch.Tensor:
        """Run the model on ``inputs``: logits ``[len(inputs.logits_rows), vocab]``."""
        if self.graphs is not None:
            logits = self.graphs.run(inputs, layer_hook)
            if logits is not None:
                return logits
        # Every integer of the step in one tensor (one creation, one copy to a GPU), cut
        # into views: a batch-1 CPU step made six small tensors here.
        parts = [inputs.ids, inputs.positions, inputs.slots, inputs.logits_rows]
        for _, _, tables, ctx, _ in inputs.decode_groups:
            parts += (list(chain.from_iterable(tables)), ctx)
        parts += (table for *_, table in inputs.prefills)
        views = iter(torch.tensor(list(chain.from_iterable(parts)), dtype=torch.long,
                                  device=self.device).split([len(p) for p in parts]))
        ids, positions, slots, logits_rows = (next(views) for _ in range(4))
        groups = [DecodeGroup(start=start, size=size,
                              block_tables=next(views).view(size, len(tables[0])),
                              context_lens=next(views), max_context_len=max_ctx)
                  for start, size, tables, _, max_ctx in inputs.decode_groups]
        segments = [PrefillSegment(start=start, query_len=n, context_len=end,
                                   block_table=next(views))
                    for start, n, end, _ in inputs.prefills]
        meta = AttentionMetadata(slot_mapping=slots, decode_groups=groups, prefills=segments)
        return self.model(ids, positions, (self.kv_cache.k, self.kv_cache.v), meta,
                          logits_rows, layer_hook)


class FusedLayers:
    """All layers of an integer-activation CPU model (w8a16/w4a16/w8a8/w4a8) for steps of
    at most ``cpu_layer.MAX_ROWS`` tokens: per layer one native call before attention and one after
    (kernels/cpu_layer.py), the backend's attention between them. Same results as the
    layer-by-layer path, bit for bit; answers None (that path runs) for larger steps and
    until the kernel is built."""

    def __init__(self, model: LlamaModel) -> None:
        self.model = model
        self._layers: list | None = None
        self._caches: tuple = (None, None, [], [])  # (K, V) and their per-layer views

    @classmethod
    def for_model(cls, model: LlamaModel, device: torch.device) -> FusedLayers | None:
        """The fused path for ``model``, or None with one log line saying why not."""
        why = _not_fusable(model, device)
        if why is not None:
            log.info("decode layers run op by op: %s", why)
            return None
        cpu_layer.ready()  # start the build (make test / run-local build it beforehand)
        log.info("steps of up to %d tokens run each layer in two native calls "
                 "(kernels/cpu_layer.py; %s=0 turns this off)", cpu_layer.MAX_ROWS,
                 cpu_layer.ENV)
        return cls(model)

    def _build(self) -> list:
        m = self.model
        cos, sin = m.rotary.tables(torch.device("cpu"))

        def proj(p: A8Linear) -> tuple:
            return (p.packed, p.scale, p.offset, p.bits, p.out_features, p.bias)
        layers = []
        for layer in m.layers:
            attn, mlp = layer.self_attn, layer.mlp
            ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
            layers.append(cpu_layer.make_layer(
                ln1.weight.detach(), ln1.eps, proj(attn.qkv_proj), proj(attn.o_proj),
                ln2.weight.detach(), ln2.eps, proj(mlp.gate_up_proj), proj(mlp.down_proj),
                cos, sin, attn.num_heads, attn.num_kv_heads, attn.head_dim, mlp.inter,
                attn.qkv_proj.levels))
        return layers

    def _views(self, k_all: torch.Tensor, v_all: torch.Tensor) -> tuple[list, list]:
        k0, v0, ks, vs = self._caches
        if k0 is not k_all or v0 is not v_all:  # per-layer views once, not every step
            ks, vs = list(k_all.unbind(0)), list(v_all.unbind(0))
            self._caches = (k_all, v_all, ks, vs)
        return ks, vs

    def __call__(self, x, positions, k_all, v_all, meta, layer_hook=None):
        if x.shape[0] > cpu_layer.MAX_ROWS or x.dtype != torch.float32:
            return None
        if self._layers is None:
            if not cpu_layer.ready():
                return None
            self._layers = self._build()
        attend = self.model.backend.forward
        ks, vs = self._views(k_all, v_all)
        residual = None
        for i, layer in enumerate(self._layers):
            q, k, v = layer.pre(x, residual, positions)
            if residual is None:  # the first layer: x is the stream itself
                residual = x
            x = layer.post(attend(q, k, v, ks[i], vs[i], meta), residual)
            if layer_hook is not None:
                layer_hook(i)
        return x, residual


def _not_fusable(model: LlamaModel, device: torch.device) -> str | None:
    """Why the fused layers do not take ``model`` (None where they do)."""
    if not cpu_layer.enabled():
        return f"turned off ({cpu_layer.ENV}=0)"
    if device.type != "cpu":
        return "not on the CPU"
    if model.tp.world_size != 1:
        return "tensor parallel (each layer all-reduces between its halves)"
    if not getattr(model.backend.ops, "fused", False):
        return "the attention backend brings its own norm and rotary"
    for layer in model.layers:
        projs = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                 layer.mlp.down_proj)
        if not all(isinstance(p, A8Linear) for p in projs):
            return "weights not quantized w8a16/w4a16/w8a8/w4a8"
        if len({p.levels for p in projs}) != 1:
            return "projections round their activations differently"
        if any(n.weight.dtype != torch.float32 for n in (
                layer.input_layernorm, layer.post_attention_layernorm)):
            return "not float32"
    return None
