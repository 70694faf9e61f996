"""CUDA graphs for decode steps: one graph per padded batch size, replayed.

A decode step launches a few kernels per layer on tiny tensors; at batch 1 the CPU's
launch time, not the GPU, sets the pace. A captured graph replays them all in one call.
Shapes are baked into a graph, so a step is padded up to the next rung of a ladder of
batch sizes and its block tables to the model's full width::

    step: 5 decodes ──► rung 8:  ids   [t0 t1 t2 t3 t4  0  0  0]
                                 slots [s0 s1 s2 s3 s4 -1 -1 -1]   (-1: nothing written)
                                 ctx   [c0 c1 c2 c3 c4  1  1  1]   (padding reads block 0)

Padded rows' logits are dropped. Steps that do not fit (prefill chunks, more decodes
than the top rung, a layer hook, or the torch backend, whose shapes follow the data)
run eagerly. With ``capture=False`` the same padded path runs eagerly: how the CPU tests
check it, and the fallback's twin.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from services.engine.attention import AttentionMetadata, DecodeGroup
from services.engine.kv_cache import KVCache
from services.engine.model import LlamaModel


def batch_ladder(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every 8 up to ``max_num_seqs`` (always the last rung)."""
    rungs = [b for b in (1, 2, 4) if b < max_num_seqs]
    rungs += range(8, max_num_seqs, 8)
    return tuple(rungs) + (max_num_seqs,)


def bucket_for(n: int, ladder: tuple[int, ...]) -> int | None:
    """The smallest rung that holds ``n`` decodes; None above the top."""
    return next((b for b in ladder if b >= n), None)


class PaddedDecode(NamedTuple):
    ids: list[int]
    positions: list[int]
    slots: list[int]
    tables: list[list[int]]
    context_lens: list[int]


def pad_decode(inputs, bucket: int, width: int) -> PaddedDecode | None:
    """A decode-only step's ``StepInputs`` padded to ``bucket`` rows and ``width`` blocks
    per table; None if the step has prefill chunks or a table wider than ``width``."""
    if inputs.prefills or len(inputs.ids) > bucket:
        return None
    tables, ctx = [], []
    for _start, _size, group_tables, lens, _max in inputs.decode_groups:
        for row in group_tables:
            if len(row) > width:
                return None
            tables.append(row + [0] * (width - len(row)))
        ctx.extend(lens)
    pad = bucket - len(inputs.ids)
    return PaddedDecode(inputs.ids + [0] * pad, inputs.positions + [0] * pad,
                        inputs.slots + [-1] * pad, tables + [[0] * width] * pad,
                        ctx + [1] * pad)


def make_decode_graphs(model: LlamaModel, kv_cache: KVCache, device: torch.device,
                       max_num_seqs: int, max_model_len: int) -> DecodeGraphs | None:
    """Graphs for a single-rank CUDA model on a capturable backend; None otherwise."""
    if device.type != "cuda" or model.tp.world_size > 1 or not model.backend.capturable:
        return None
    return DecodeGraphs(model, kv_cache, device, max_num_seqs, max_model_len, capture=True)


class DecodeGraphs:
    """Runs decode-only steps padded to a rung, from graphs captured on first use of
    each rung (``capture``) or eagerly. One set of static inputs, sized for the top rung,
    backs every graph; the graphs share one memory pool (they never run at once)."""

    def __init__(self, model: LlamaModel, kv_cache: KVCache, device: torch.device,
                 max_num_seqs: int, max_model_len: int, capture: bool) -> None:
        self.model, self.kv_cache, self.capture = model, kv_cache, capture
        self.ladder = batch_ladder(max_num_seqs)
        self.width = -(-max_model_len // kv_cache.block_size)
        top = self.ladder[-1]

        def buf(*shape):
            return torch.zeros(shape, dtype=torch.long, device=device)

        self.ids, self.positions, self.slots = buf(top), buf(top), buf(top)
        self.tables, self.context_lens = buf(top, self.width), buf(top)
        self.rows = torch.arange(top, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self.replays = self.eager_steps = 0

    def run(self, inputs, layer_hook=None) -> torch.Tensor | None:
        """Logits ``[len(inputs.logits_rows), vocab]``, or None: run this step eagerly."""
        bucket = bucket_for(len(inputs.ids), self.ladder)
        if layer_hook is not None or bucket is None or not inputs.ids:
            return None
        padded = pad_decode(inputs, bucket, self.width)
        if padded is None:
            return None
        for static, values in ((self.ids, padded.ids), (self.positions, padded.positions),
                               (self.slots, padded.slots), (self.tables, padded.tables),
                               (self.context_lens, padded.context_lens)):
            static[:bucket].copy_(torch.tensor(values, dtype=torch.long), non_blocking=True)
        if not self.capture:
            self.eager_steps += 1
            logits = self._forward(bucket)
        else:
            if bucket not in self._graphs:
                self._graphs[bucket] = self._capture(bucket)
            graph, logits = self._graphs[bucket]
            graph.replay()
            self.replays += 1
        rows = torch.tensor(inputs.logits_rows, dtype=torch.long, device=logits.device)
        return logits.index_select(0, rows)

    def _forward(self, bucket: int) -> torch.Tensor:
        group = DecodeGroup(0, bucket, self.tables[:bucket], self.context_lens[:bucket],
                            self.width * self.kv_cache.block_size)
        meta = AttentionMetadata(self.slots[:bucket], [group], [])
        return self.model(self.ids[:bucket], self.positions[:bucket],
                          (self.kv_cache.k, self.kv_cache.v), meta, self.rows[:bucket])

    def _capture(self, bucket: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm first: Triton compiles and the rotary tables move outside the capture.
        # The warm step writes the same K/V the replay writes again.
        self._forward(bucket)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(bucket)
        self._pool = graph.pool()
        return graph, logits
