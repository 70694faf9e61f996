"""The baseline routing policies: a worker picker under a static disaggregation rule.

``StaticDisaggregation`` is the ``RoutingPolicy`` (``routing_policy.py``) of the
baselines: its picker (round-robin, least-loaded) only ranks candidates, and the rule
that decides where the prompt is prefilled is shared (``decide``):

* a unified (colocated) decode worker always prefills itself;
* a prompt with fewer uncached tokens than ``disagg_threshold`` prefills on its decode
  worker, where moving the KV would cost more than computing it;
* with no live prefill worker of the same model fingerprint, decode prefills itself.

The baselines never reject and ignore SLOs, the prefix index and the cost model.
"""

from __future__ import annotations

import collections
import itertools
from abc import ABC, abstractmethod

from services.conductor.registry import WorkerView
from services.conductor.routing_policy import (
    Decision,
    NoWorkers,  # noqa: F401 (raised by decide; importers of this module catch it)
    PolicyRequest,
    RoutingPolicy,
    candidates,
)


class Picker(ABC):
    name: str

    @abstractmethod
    def pick(self, candidates: list[WorkerView], prompt_tokens: int) -> WorkerView:
        """Choose one of ``candidates`` (never empty)."""


class RoundRobin(Picker):
    """Each role's workers in turn (decode and prefill picks keep separate turns)."""

    name = "round_robin"

    def __init__(self) -> None:
        self._counters: dict[str, itertools.count] = collections.defaultdict(itertools.count)

    def pick(self, candidates, prompt_tokens):
        ordered = sorted(candidates, key=lambda w: w.worker_id)
        return ordered[next(self._counters[ordered[0].role]) % len(ordered)]


class LeastLoaded(Picker):
    """Fewest requests (running + waiting + waiting for KV + routed since the last
    heartbeat), then fewest queued prefill tokens, then the most unpromised KV blocks."""

    name = "least_loaded"

    def pick(self, candidates, prompt_tokens):
        return min(candidates, key=lambda w: (
            w.load, w.queued_prefill_tokens + w.pending_tokens, -w.unpromised_blocks,
            w.worker_id))


PICKERS = {p.name: p for p in (RoundRobin, LeastLoaded)}


def make_picker(name: str) -> Picker:
    if name not in PICKERS:
        raise ValueError(f"unknown worker picker {name!r}; choose from {sorted(PICKERS)}")
    return PICKERS[name]()


class StaticDisaggregation(RoutingPolicy):
    """A baseline: ``picker`` chooses the workers, ``decide``'s static rule where the
    prompt is prefilled; every decision is accounted with ``account``."""

    def __init__(self, picker: Picker, disagg_threshold: int = 256) -> None:
        if disagg_threshold < 0:
            raise ValueError(f"disagg_threshold must be >= 0, got {disagg_threshold}")
        self.picker = picker
        self.name = picker.name
        self.disagg_threshold = disagg_threshold

    def decide(self, workers: list[WorkerView], request: PolicyRequest) -> Decision:
        if request.prompt_tokens <= 0:
            raise ValueError(f"bad request: prompt_tokens {request.prompt_tokens}")
        d = decide(workers, self.picker, model=request.model,
                   prompt_tokens=request.prompt_tokens,
                   disagg_threshold=self.disagg_threshold, exclude=request.exclude)
        account(d, request.prompt_tokens)
        return d


def decide(workers: list[WorkerView], picker: Picker, *, model: str, prompt_tokens: int,
           cached_tokens: int = 0, disagg_threshold: int = 256,
           exclude: frozenset[str] = frozenset()) -> Decision:
    """The static disaggregation rule (module docstring); accounts nothing."""
    usable, decoders = candidates(workers, PolicyRequest(prompt_tokens, model=model,
                                                         exclude=exclude))
    decode = picker.pick(decoders, prompt_tokens)
    if decode.role == "unified":
        return Decision(decode, None, "colocated")
    uncached = prompt_tokens - cached_tokens
    if uncached < disagg_threshold:
        return Decision(decode, None, f"short prompt ({uncached} < {disagg_threshold})")
    prefillers = [w for w in usable if w.role == "prefill"
                  and w.fingerprint == decode.fingerprint]
    if not prefillers:
        return Decision(decode, None, "no prefill worker")
    return Decision(decode, picker.pick(prefillers, prompt_tokens), "disaggregated")


def account(decision: Decision, prompt_tokens: int) -> None:
    """Count a decision against its workers until their next heartbeat."""
    decision.decode.pending_requests += 1
    if decision.prefill is not None:
        decision.prefill.pending_requests += 1
        decision.prefill.pending_tokens += prompt_tokens
    else:
        decision.decode.pending_tokens += prompt_tokens
