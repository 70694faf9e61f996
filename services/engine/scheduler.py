"""Continuous batching: which sequences run in the next step, and how many tokens each.

Each step has a token budget. Running sequences go first, in admission order: a
decoding sequence takes one token, a sequence still prefilling takes its next chunk.
Waiting sequences are then admitted while budget, sequence slots and blocks last, each
starting from its longest cached prefix. Decodes and prefill chunks share one batch.

A step that carries a prefill chunk makes every decoding sequence in it wait for the
chunk. ``max_prefill_tokens_with_decode`` caps the prompt tokens of a step in which any
sequence decodes (small chunks interleaved with decode steps, as in chunked prefill
with a stall-free budget), so a new prompt stretches each running stream's next token
by at most that much prefill; with nothing decoding, prompts take the full budget.

When a running sequence needs a block and none is free, the newest running sequence is
preempted: its blocks are freed (its full blocks stay in the prefix cache) and it waits
at the front of the queue to be recomputed.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from services.engine.kv_manager import KVCacheManager
from services.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    prefill_chunk_size: int | None = None  # cap on one sequence's tokens per step
    # Cap on the prompt tokens of a step in which any sequence decodes; None: no cap
    # beyond the step's token budget.
    max_prefill_tokens_with_decode: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.prefill_chunk_size is not None and self.prefill_chunk_size < 1:
            raise ValueError("prefill_chunk_size must be >= 1")
        if (self.max_prefill_tokens_with_decode is not None
                and self.max_prefill_tokens_with_decode < 0):
            raise ValueError("max_prefill_tokens_with_decode must be >= 0")


class ScheduledSeq(NamedTuple):
    seq: Sequence
    num_new_tokens: int


def is_decoding(seq: Sequence) -> bool:
    """``seq`` has sampled and its next step computes exactly its last token."""
    return bool(seq.output_token_ids) and seq.num_tokens - seq.num_computed_tokens == 1


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.chunk = config.prefill_chunk_size or config.max_num_batched_tokens
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take ``seq`` out of the queues (finished or aborted); the caller frees blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)

    def schedule(self) -> list[ScheduledSeq]:
        """The next step's sequences and token counts; admitted sequences hold their blocks."""
        budget = self.config.max_num_batched_tokens
        # Prompt tokens this step may take: capped while anything decodes (module doc).
        prefill_left = budget
        cap = self.config.max_prefill_tokens_with_decode
        if cap is not None and cap < budget and any(is_decoding(s) for s in self.running):
            prefill_left = cap
        scheduled: list[ScheduledSeq] = []
        preempted = False  # admit nobody new in a step that had to preempt

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            decoding = is_decoding(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget, self.chunk)
            if not decoding:
                n = min(n, prefill_left)
                if n == 0:  # no prompt tokens left this step: decodes after it still go
                    i += 1
                    continue
            while not self.kv.allocate_slots(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            if not decoding:
                prefill_left -= n
            i += 1

        while (not preempted and self.waiting and budget > 0 and prefill_left > 0
               and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting[0]
            prefix = self.kv.match_prefix(seq)
            start = prefix.num_blocks * self.kv.block_size
            n = min(seq.num_tokens - start, budget, self.chunk, prefill_left)
            if not self.kv.allocate_slots(seq, n, prefix):
                break
            self.waiting.popleft()
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = start
            seq.num_computed_tokens = start
            seq.status = SequenceStatus.RUNNING
            if seq.scheduled_time is None:
                seq.scheduled_time = time.monotonic()
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            prefill_left -= n
        return scheduled

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
