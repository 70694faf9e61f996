"""Turns a scheduled step into tensors, runs the model, and returns logits to sample."""

from __future__ import annotations

from typing import NamedTuple

import msgpack
import torch

from services.engine.attention import AttentionMetadata, DecodeGroup, PrefillSegment
from services.engine.kv_cache import KVCache
from services.engine.model import LlamaModel
from services.engine.scheduler import ScheduledSeq
from services.engine.sequence import Sequence

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
        dev = self.device

        def tensor(values) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=dev)

        groups = [DecodeGroup(start=start, size=size, block_tables=tensor(tables),
                              context_lens=tensor(ctx), max_context_len=max_ctx)
                  for start, size, tables, ctx, max_ctx in inputs.decode_groups]
        segments = [PrefillSegment(start=start, query_len=n, context_len=end,
                                   block_table=tensor(table))
                    for start, n, end, table in inputs.prefills]
        meta = AttentionMetadata(slot_mapping=tensor(inputs.slots), decode_groups=groups,
                                 prefills=segments)
        return self.model(tensor(inputs.ids), tensor(inputs.positions),
                          (self.kv_cache.k, self.kv_cache.v), meta,
                          tensor(inputs.logits_rows), layer_hook)
