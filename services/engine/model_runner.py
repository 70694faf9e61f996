"""Turns a scheduled step into tensors, runs the model, and returns logits to sample."""

from __future__ import annotations

import torch

from services.engine.attention import AttentionMetadata, DecodeGroup, PrefillSegment
from services.engine.kv_cache import KVCache
from services.engine.model import LlamaModel
from services.engine.scheduler import ScheduledSeq
from services.engine.sequence import Sequence

# Decodes are attended in groups of similar context length so that padding each
# group to its longest member wastes little.
DECODE_GROUP_SIZE = 16


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: KVCache, device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.device = device

    def run(self, batch: list[ScheduledSeq],
            layer_hook=None) -> tuple[torch.Tensor, list[Sequence]]:
        """Compute the scheduled tokens; return logits for each sequence that samples.

        A sequence samples when this step computes its last known token. Row i of the
        logits belongs to the i-th returned sequence.
        """
        decodes = sorted((s for s in batch if s.num_new_tokens == 1),
                         key=lambda s: s.seq.num_computed_tokens)
        prefills = [s for s in batch if s.num_new_tokens > 1]
        bs = self.block_size

        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sampling: list[Sequence] = []
        logits_rows: list[int] = []
        groups: list[DecodeGroup] = []
        for g in range(0, len(decodes), DECODE_GROUP_SIZE):
            members = decodes[g:g + DECODE_GROUP_SIZE]
            ctx = [m.seq.num_computed_tokens + 1 for m in members]
            width = -(-max(ctx) // bs)
            tables = [m.seq.block_table[:width] + [0] * (width - len(m.seq.block_table[:width]))
                      for m in members]
            groups.append(DecodeGroup(
                start=len(ids), size=len(members),
                block_tables=torch.tensor(tables, dtype=torch.long, device=self.device),
                context_lens=torch.tensor(ctx, dtype=torch.long, device=self.device),
                max_context_len=max(ctx)))
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

        segments: list[PrefillSegment] = []
        for seq, n in prefills:
            start = seq.num_computed_tokens
            end = start + n
            table = torch.tensor(seq.block_table, dtype=torch.long)
            pos = torch.arange(start, end)
            segments.append(PrefillSegment(
                start=len(ids), query_len=n, context_len=end,
                block_table=table.to(self.device)))
            ids.extend(seq.token_ids()[start:end])
            positions.extend(pos.tolist())
            slots.extend((table[pos // bs] * bs + pos % bs).tolist())
            if end == seq.num_tokens:
                sampling.append(seq)
                logits_rows.append(len(ids) - 1)

        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            decode_groups=groups, prefills=segments)
        logits = self.model(
            torch.tensor(ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            (self.kv_cache.k, self.kv_cache.v), meta,
            torch.tensor(logits_rows, dtype=torch.long, device=self.device), layer_hook)
        return logits, sampling
