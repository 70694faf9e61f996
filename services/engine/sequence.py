"""One request's state inside an engine: its tokens, its blocks and how far it has got."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from common.sampling_params import SamplingParams
from services.engine.sampling_state import SamplingState, TokenLogprobs


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to recompute
    WAITING_FOR_KV = "waiting_for_kv"  # blocks reserved, KV arriving from elsewhere
    RUNNING = "running"
    DETACHED = "detached"  # no longer stepped, blocks held: its KV is moving elsewhere
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingState
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    scheduled_time: float | None = None  # first admitted to the running batch
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # of full, computed blocks
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens reused from the prefix cache at admission
    num_preemptions: int = 0
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    hold_blocks: bool = False  # keep blocks after finishing until released (KV export)

    @property
    def params(self) -> SamplingParams:
        return self.sampling.params

    @property
    def output_token_ids(self) -> list[int]:
        return self.sampling.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.sampling.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.sampling.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
