"""Batched next-token sampling over a ``[B, V]`` logits tensor, one row per sequence.

Per row, in this order::

    raw logits ──► logprobs are reported from this distribution
       │
       ├─ min_tokens: EOS and stop ids → -inf while fewer than min_tokens exist
       ├─ repetition penalty     (prompt + output tokens)
       ├─ presence / frequency   (output tokens)
       ├─ greedy rows: argmax
       └─ other rows: temperature → top-k → top-p → min-p → draw

Each step runs only on the rows that need it (none: skipped, all: in place, some: on a
copy of those rows), so a row's result never depends on the other rows' parameters.
A seeded row draws its noise from its own generator, reseeded for every token from
(seed, output position): a seed gives the same tokens whatever else is in the batch,
and an engine that picks a sequence up mid-way (after a KV transfer, or a preemption)
continues the same draws. Unseeded rows use torch's global generator.

The sampler does not decide when a sequence ends; the engine does, with ``check_stop``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import chain
from typing import NamedTuple

import torch

from common.sampling_params import SamplingParams
from services.engine.sampling_state import (  # noqa: F401  (re-exported)
    SamplingState,
    TokenLogprobs,
    check_stop,
    position_seed,
)

# Temperatures in (0, MIN_TEMPERATURE) are raised to it so logits / t stays finite.
MIN_TEMPERATURE = 1e-5
_NEG_INF = float("-inf")


class SampleResult(NamedTuple):
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None where params.logprobs is None


RowFn = Callable[[torch.Tensor, list[SamplingState]], None]


def _on_rows(logits: torch.Tensor, states: Sequence[SamplingState],
             wanted: Callable[[SamplingParams], bool], fn: RowFn) -> None:
    """Run the in-place ``fn(rows, their_states)`` on the rows whose params are wanted."""
    rows = [i for i, s in enumerate(states) if wanted(s.params)]
    if not rows:
        return
    if len(rows) == len(states):
        fn(logits, list(states))
        return
    index = torch.tensor(rows, device=logits.device)
    sub = logits.index_select(0, index)
    fn(sub, [states[i] for i in rows])
    logits.index_copy_(0, index, sub)


def _values(logits: torch.Tensor, values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=logits.dtype, device=logits.device)


def _column(logits: torch.Tensor, values: list[float]) -> torch.Tensor:
    return _values(logits, values).unsqueeze(1)


def _token_keys(logits: torch.Tensor, token_lists: list[Sequence[int]]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct (row, token) pairs over ``token_lists``, with how often each occurs."""
    vocab = logits.shape[1]
    cols = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.long)
    if cols.numel() and (int(cols.min()) < 0 or int(cols.max()) >= vocab):
        raise ValueError(f"token ids must be in [0, {vocab}), got {int(cols.min())}.."
                         f"{int(cols.max())}")
    rows = torch.repeat_interleave(torch.arange(len(token_lists)),
                                   torch.tensor([len(t) for t in token_lists]))
    keys, counts = torch.unique(rows * vocab + cols, return_counts=True)
    keys = keys.to(logits.device)
    return (keys // vocab, keys % vocab), counts.to(logits.device, logits.dtype)


def _repetition(logits: torch.Tensor, states: list[SamplingState]) -> None:
    (rows, cols), _ = _token_keys(
        logits, [[*s.prompt_token_ids, *s.output_token_ids] for s in states])
    penalty = _values(logits, [s.params.repetition_penalty for s in states])[rows]
    values = logits[rows, cols]
    logits[rows, cols] = torch.where(values > 0, values / penalty, values * penalty)


def _presence_frequency(logits: torch.Tensor, states: list[SamplingState]) -> None:
    (rows, cols), counts = _token_keys(logits, [s.output_token_ids for s in states])
    presence = _values(logits, [s.params.presence_penalty for s in states])
    frequency = _values(logits, [s.params.frequency_penalty for s in states])
    logits[rows, cols] -= frequency[rows] * counts + presence[rows]


def apply_penalties(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Apply repetition, then presence and frequency penalties to float ``logits`` in
    place; returns it. Rows whose penalties are neutral are left bit-for-bit alone."""
    _check_batch(logits, states)
    _on_rows(logits, states, lambda p: p.repetition_penalty != 1.0, _repetition)
    _on_rows(logits, states, lambda p: p.presence_penalty != 0.0 or p.frequency_penalty != 0.0,
             _presence_frequency)
    return logits


def apply_min_tokens(logits: torch.Tensor, states: Sequence[SamplingState],
                     eos_token_ids: Sequence[int]) -> torch.Tensor:
    """Set EOS and stop ids to -inf in place for rows with fewer than min_tokens outputs.

    EOS is suppressed even with ``ignore_eos``: min_tokens applies regardless.
    """
    vocab = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    for i, s in enumerate(states):
        if len(s.output_token_ids) < s.params.min_tokens:
            banned = {t for t in (*eos_token_ids, *s.params.stop_token_ids) if t < vocab}
            rows += [i] * len(banned)
            cols += banned
    if rows:
        logits[torch.tensor(rows, device=logits.device),
               torch.tensor(cols, device=logits.device)] = _NEG_INF
    return logits


def _top_k(logits: torch.Tensor, states: list[SamplingState]) -> None:
    k = [min(s.params.top_k, logits.shape[1]) for s in states]
    largest = logits.topk(max(k), dim=1).values
    index = torch.tensor(k, device=logits.device).unsqueeze(1) - 1
    logits.masked_fill_(logits < largest.gather(1, index), _NEG_INF)


def _top_p(logits: torch.Tensor, states: list[SamplingState]) -> None:
    # Keep the most likely tokens while the mass strictly above each is < p: the
    # smallest top set holding at least p, plus ties with its last token. Sorting the
    # whole vocabulary is slow on CPU, so look in the top 256, then the top 4096, and
    # sort only the rows whose nucleus is wider still.
    probs = logits.softmax(dim=1)
    top_p = _values(logits, [s.params.top_p for s in states])
    vocab = probs.shape[1]
    floor = torch.empty_like(top_p)
    pending = torch.arange(len(states), device=logits.device)
    for k in (*(k for k in (256, 4096) if k < vocab), vocab):
        rows = probs.index_select(0, pending)
        top = (rows.topk(k, dim=1) if k < vocab else rows.sort(dim=1, descending=True)).values
        mass = top.cumsum(dim=1)
        p = top_p.index_select(0, pending)
        # At k == vocab every row is done, even if rounding leaves its total below p.
        covered = mass[:, -1] >= p if k < vocab else torch.ones_like(p, dtype=torch.bool)
        kept = ((mass - top)[covered] < p[covered].unsqueeze(1)).sum(dim=1, keepdim=True)
        floor[pending[covered]] = top[covered].gather(1, kept - 1).squeeze(1)
        pending = pending[~covered]
        if not pending.numel():
            break
    logits.masked_fill_(probs < floor.unsqueeze(1), _NEG_INF)


def _min_p(logits: torch.Tensor, states: list[SamplingState]) -> None:
    probs = logits.softmax(dim=1)
    floor = probs.amax(dim=1, keepdim=True) * _column(logits, [s.params.min_p for s in states])
    logits.masked_fill_(probs < floor, _NEG_INF)


def apply_top_k(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Set all but each row's top_k largest logits (and ties with the k-th) to -inf, in
    place; returns it. Rows with top_k 0 or >= V are untouched."""
    _check_batch(logits, states)
    _on_rows(logits, states, lambda p: 0 < p.top_k < logits.shape[1], _top_k)
    return logits


def apply_top_p(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Set logits outside each row's nucleus to -inf, in place; returns it.

    The nucleus is the smallest set of most likely tokens whose probability under
    softmax(logits) reaches top_p, plus tokens tied with its least likely member.
    """
    _check_batch(logits, states)
    _on_rows(logits, states, lambda p: p.top_p < 1.0, _top_p)
    return logits


def apply_min_p(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Set logits whose probability is below min_p times the row's top probability to
    -inf, in place; returns it."""
    _check_batch(logits, states)
    _on_rows(logits, states, lambda p: p.min_p > 0.0, _min_p)
    return logits


def _draw(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """Filter and draw one token per row; ``logits`` is a scratch tensor."""
    temperatures = [max(s.params.temperature, MIN_TEMPERATURE) for s in states]
    if any(t != 1.0 for t in temperatures):
        logits.div_(_column(logits, temperatures))
    apply_top_k(logits, states)
    apply_top_p(logits, states)
    apply_min_p(logits, states)
    probs = logits.softmax(dim=1)
    # Exponential race: argmax(p / E) with E = -log(U) ~ Exp(1) picks token i with
    # probability p_i. U is in [0, 1), so E is in (0, inf]: no 0 / 0, and E is drawn
    # from uniforms because exponential_ is several times slower on CPU.
    noise = torch.empty_like(probs)
    unseeded = [i for i, s in enumerate(states) if s.generator is None]
    if len(unseeded) == len(states):
        noise.uniform_()
    elif unseeded:
        index = torch.tensor(unseeded, device=probs.device)
        noise.index_copy_(0, index, torch.rand((len(unseeded), probs.shape[1]),
                                               dtype=probs.dtype, device=probs.device))
    for i, s in enumerate(states):
        if s.generator is not None:
            s.generator.manual_seed(position_seed(s.params.seed, len(s.output_token_ids)))
            noise[i].copy_(torch.rand(probs.shape[1], dtype=probs.dtype,
                                      device=s.generator.device, generator=s.generator))
    noise.log_().neg_()
    return probs.div_(noise).argmax(dim=1)


def _logprobs(raw: torch.Tensor, tokens: torch.Tensor,
              states: Sequence[SamplingState]) -> list[TokenLogprobs | None]:
    result: list[TokenLogprobs | None] = [None] * len(states)
    rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
    if not rows:
        return result
    index = torch.tensor(rows, device=raw.device)
    logprobs = raw.index_select(0, index).float().log_softmax(dim=1)
    chosen_ids = tokens.index_select(0, index).unsqueeze(1)
    chosen = logprobs.gather(1, chosen_ids)
    ranks = (logprobs > chosen).sum(dim=1) + 1
    n = max(states[i].params.logprobs or 0 for i in rows)
    top_values, top_ids = logprobs.topk(n, dim=1)
    ids, values, rank = chosen_ids.squeeze(1).tolist(), chosen.squeeze(1).tolist(), ranks.tolist()
    top_v, top_i = top_values.tolist(), top_ids.tolist()
    for j, i in enumerate(rows):
        k = states[i].params.logprobs or 0
        top = list(zip(top_i[j][:k], top_v[j][:k], strict=True))
        result[i] = TokenLogprobs(ids[j], values[j], rank[j], top)
    return result


def _check_batch(logits: torch.Tensor, states: Sequence[SamplingState]) -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a 2-D float tensor, got {tuple(logits.shape)} "
                         f"{logits.dtype}")
    if logits.shape[0] != len(states):
        raise ValueError(f"logits has {logits.shape[0]} rows for {len(states)} states")


class Sampler:
    """Picks one token per row of a logits batch; stateless apart from the EOS ids."""

    def __init__(self, eos_token_ids: Sequence[int]) -> None:
        self.eos_token_ids = tuple(eos_token_ids)

    def sample(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> SampleResult:
        """Sample row i of ``logits`` ([B, V], any float dtype) for ``states[i]``.

        ``logits`` is not modified. Work is done in float32. Advances the generators of
        seeded, non-greedy rows and the global generator when unseeded rows sample.
        """
        _check_batch(logits, states)
        params = [s.params for s in states]
        suppress = any(len(s.output_token_ids) < s.params.min_tokens for s in states)
        penalize = any(p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
                       or p.frequency_penalty != 0.0 for p in params)
        if not suppress and not penalize and all(p.greedy for p in params):
            tokens = logits.argmax(dim=1)
        else:
            work = logits.to(torch.float32, copy=True)
            apply_min_tokens(work, states, self.eos_token_ids)
            apply_penalties(work, states)
            drawn = [i for i, p in enumerate(params) if not p.greedy]
            if len(drawn) == len(states):
                tokens = _draw(work, list(states))
            else:
                tokens = work.argmax(dim=1)
                if drawn:
                    index = torch.tensor(drawn, device=work.device)
                    tokens.index_copy_(0, index, _draw(work.index_select(0, index),
                                                       [states[i] for i in drawn]))
        return SampleResult(tokens.tolist(), _logprobs(logits, tokens, states))
