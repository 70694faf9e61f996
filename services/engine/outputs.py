"""What the engine reports about a request after a step, and at the end."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from common.sampling_params import SamplingParams
from services.engine.sampling_state import TokenLogprobs


@dataclass(slots=True)
class RequestOutput:
    """A request's progress in one step: the tokens it gained, and whether it ended."""

    request_id: str
    new_token_ids: list[int]
    num_output_tokens: int
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length" or "abort"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    new_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    queue_time_s: float | None = None  # set on a request's first token only


class Completion(NamedTuple):
    """A finished request from :meth:`LLMEngine.generate`."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    num_cached_tokens: int
    logprobs: list[TokenLogprobs | None]


class RemoteSlots(NamedTuple):
    """Blocks reserved for a prompt whose KV will be written by another engine.

    ``block_ids`` cover the whole prompt; the first ``num_cached_blocks`` already hold
    this engine's cached prefix, so only ``block_ids[num_cached_blocks:]`` need KV.
    """

    block_ids: list[int]
    num_cached_blocks: int


class Detached(NamedTuple):
    """A running request taken out of an engine to continue elsewhere, KV and all.

    ``block_ids`` hold the KV of every token of ``prompt_token_ids`` + ``output_token_ids``
    but the last, which the next engine computes first."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    block_ids: list[int]
    num_cached_tokens: int


class StepRecord(NamedTuple):
    """What one engine step computed, for the cost model's online fit.

    ``prefill`` holds, per prompt chunk in the step, (tokens computed now, tokens of the
    sequence already in the KV cache); ``decode_batch`` counts sequences that computed
    one token after their last output, over ``decode_context`` tokens of KV in all.
    """

    prefill: tuple[tuple[int, int], ...]
    decode_batch: int
    decode_context: int

    @classmethod
    def of(cls, scheduled) -> StepRecord:
        """From ``(sequence, new tokens)`` pairs, before the step updates the sequences."""
        prefill, batch, context = [], 0, 0
        for seq, n in scheduled:
            if n == 1 and seq.output_token_ids and seq.num_computed_tokens + 1 == seq.num_tokens:
                batch += 1
                context += seq.num_computed_tokens
            else:
                prefill.append((n, seq.num_computed_tokens))
        return cls(tuple(prefill), batch, context)


class EngineDeadError(RuntimeError):
    """A tensor-parallel rank died or stopped answering: this engine cannot step again.
    Here, not in ``tp.py``, so that what catches it need not import torch."""
