"""The computation an engine step runs: the ``Executor`` contract.

Two executors implement it: ``ModelExecutor`` (``services/engine/engine.py``: the model's
forward pass and the sampler) and ``SimExecutor`` (``services/engine/sim.py``: a sleep a
cost profile sizes). The engine core schedules; the executor computes what it scheduled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

from services.engine.sampling_state import TokenLogprobs
from services.engine.scheduler import ScheduledSeq
from services.engine.sequence import Sequence

LayerHook = Callable[[int], None]


def completing_prompts(scheduled: list[ScheduledSeq]) -> list[Sequence]:
    """The sequences whose prompt this step completes (first time, not a recompute):
    the ones a layer hook streams out."""
    return [seq for seq, n in scheduled if not seq.output_token_ids
            and seq.num_computed_tokens + n == seq.num_prompt_tokens]


class Sampled(NamedTuple):
    """The token one sequence drew in a step."""

    seq: Sequence
    token_id: int
    logprobs: TokenLogprobs | None


class Executor(Protocol):
    def execute(self, scheduled: list[ScheduledSeq],
                layer_hook: LayerHook | None) -> list[Sampled]:
        """Compute the scheduled tokens and sample where a sequence reaches its end.

        Contract: write each scheduled token's KV into the sequence's blocks (its
        ``block_table``, which covers them); when ``layer_hook`` is given, call
        ``layer_hook(layer)`` once per layer, in order, as soon as that layer's KV of
        this step is written. Return one :class:`Sampled` per sequence whose scheduled
        tokens reach its last known token (``num_computed_tokens + n == num_tokens``),
        in the order scheduled. Change no sequence: the core advances them afterwards.
        """
        ...
