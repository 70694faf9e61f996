"""Tensor parallelism: which slice of the model a rank holds, and the collectives that
join the slices (Megatron-style).

Per layer, with ``N`` ranks::

    qkv_proj   column-parallel: rank r holds query heads [r*H/N, (r+1)*H/N) and their
               KV heads (KV/N of them; when N > KV each KV head is replicated on N/KV
               consecutive ranks)
    o_proj     row-parallel over the same heads, then an all-reduce of the hidden state
    gate_up    column-parallel: intermediate columns [r*I/N, (r+1)*I/N) of gate and of up
    down_proj  row-parallel over those columns, then an all-reduce

The embedding and the output head are vocab-parallel: rank r holds vocab rows
[r*V', (r+1)*V') with V' = ceil(V/N) (the last shard zero-padded). A token's embedding
is looked up on the rank holding its row, zeros elsewhere, and all-reduced; logits are
all-gathered (each rank ends with the whole vocabulary; rank 0 samples).

``ParallelContext`` is what a model is built with; ``SINGLE`` (one rank) makes every
collective a no-op, so the one-device engine runs the same code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from services.engine.model_config import ModelConfig
from services.engine.outputs import EngineDeadError  # noqa: F401  (raised by tp_group)


@dataclass(frozen=True, slots=True)
class ParallelContext:
    rank: int = 0
    world_size: int = 1
    group: Any = None  # the torch.distributed group of the model's collectives

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns it."""
        if self.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` concatenated along the last dimension, rank order."""
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = ParallelContext()


@dataclass(frozen=True, slots=True)
class ShardShape:
    """The slice of one model that rank ``rank`` of ``world_size`` holds."""

    num_heads: int  # query heads on this rank
    head_start: int  # first query head on this rank
    num_kv_heads: int  # KV heads on this rank (KV cache heads too)
    kv_head_start: int
    intermediate: int  # MLP columns on this rank
    inter_start: int
    vocab: int  # vocab rows per rank (the last rank's zero-padded)
    vocab_start: int


def check_shardable(cfg: ModelConfig, world_size: int) -> None:
    """``ValueError`` naming what does not divide when ``cfg`` cannot split ``world_size``
    ways."""
    if world_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world_size}")
    kv = cfg.num_kv_heads
    problems = []
    if cfg.num_heads % world_size:
        problems.append(f"{cfg.num_heads} attention heads")
    if kv % world_size and world_size % kv:
        problems.append(f"{kv} KV heads (nor does {world_size} divide by them)")
    if cfg.intermediate_size % world_size:
        problems.append(f"intermediate size {cfg.intermediate_size}")
    if problems:
        raise ValueError(f"tensor_parallel_size {world_size} does not divide the model's "
                         + ", ".join(problems))


def shard_shape(cfg: ModelConfig, rank: int, world_size: int) -> ShardShape:
    check_shardable(cfg, world_size)
    heads = cfg.num_heads // world_size
    if cfg.num_kv_heads >= world_size:
        kv_heads, kv_start = cfg.num_kv_heads // world_size, rank * cfg.num_kv_heads // world_size
    else:  # more ranks than KV heads: each KV head serves world_size / KV ranks
        kv_heads, kv_start = 1, rank // (world_size // cfg.num_kv_heads)
    inter = cfg.intermediate_size // world_size
    vocab = -(-cfg.vocab_size // world_size)
    return ShardShape(heads, rank * heads, kv_heads, kv_start, inter, rank * inter,
                      vocab, rank * vocab)
