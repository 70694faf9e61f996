"""What an engine keeps per sequence for sampling, and when a sequence stops.

Free of torch, so that engines that run no model (the simulated executor) share the
request lifecycle with the real one; ``SamplingState.create`` imports torch only for a
seeded request's generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from common.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


class TokenLogprobs(NamedTuple):
    """The chosen token under the model's raw distribution: log_softmax of the logits
    before min_tokens, penalties and temperature."""

    token_id: int
    logprob: float
    rank: int  # 1 = most likely; tied tokens share the better rank
    top: list[tuple[int, float]]  # the params.logprobs most likely (token, logprob), best first


@dataclass(slots=True)
class SamplingState:
    """What the sampler needs to know about one running sequence.

    The engine owns it for the sequence's lifetime and appends every generated token
    to ``output_token_ids`` after each step.
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None

    @classmethod
    def create(cls, params: SamplingParams, prompt_token_ids: Sequence[int],
               device: Any = "cpu", *, seeded_generator: bool = True) -> SamplingState:
        """A fresh state; seeded params get their own generator on ``device`` unless
        ``seeded_generator`` is False (an engine that draws no random numbers)."""
        generator = None
        if params.seed is not None and seeded_generator:
            import torch

            generator = torch.Generator(device=device)
            generator.manual_seed(params.seed)
        return cls(params, prompt_token_ids, [], generator)


def position_seed(seed: int, position: int) -> int:
    """A 64-bit seed for the draw of output token ``position`` (splitmix64 mixing)."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


def check_stop(state: SamplingState, token_id: int, eos_token_ids: Sequence[int]) -> str | None:
    """Why the sequence ends with ``token_id``, or None when it goes on.

    Call it after appending ``token_id`` to ``state.output_token_ids``; raises
    ``ValueError`` if the output does not end with it.

    - ``"stop"``: ``token_id`` is a stop id, or an EOS id unless ``ignore_eos``; counts
      only when at least ``min_tokens`` tokens were generated before it.
    - ``"length"``: the output now holds ``max_tokens`` tokens.
    """
    output = state.output_token_ids
    if not output or output[-1] != token_id:
        raise ValueError(f"check_stop expects token {token_id} appended to the output first")
    params = state.params
    if len(output) > params.min_tokens and (
            token_id in params.stop_token_ids
            or (not params.ignore_eos and token_id in eos_token_ids)):
        return "stop"
    if len(output) >= params.max_tokens:
        return "length"
    return None
