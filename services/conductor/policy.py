"""Routing policies: pure objects, state in, decision out, no I/O.

``decide`` picks a decode worker and either a prefill worker or local prefill. The
policy object only ranks candidates; the disaggregation rule is shared:

* a unified (colocated) decode worker always prefills itself;
* a prompt with fewer uncached tokens than ``disagg_threshold`` prefills on its decode
  worker, where moving the KV would cost more than computing it;
* with no live prefill worker of the same model fingerprint, decode prefills itself.
"""

from __future__ import annotations

import collections
import itertools
from abc import ABC, abstractmethod
from typing import NamedTuple

from services.conductor.registry import WorkerView


class NoWorkers(RuntimeError):
    """No live worker can serve this request."""


class Decision(NamedTuple):
    decode: WorkerView
    prefill: WorkerView | None
    reason: str


class Policy(ABC):
    name: str

    @abstractmethod
    def pick(self, candidates: list[WorkerView], prompt_tokens: int) -> WorkerView:
        """Choose one of ``candidates`` (never empty)."""


class RoundRobin(Policy):
    """Each role's workers in turn (decode and prefill picks keep separate turns)."""

    name = "round_robin"

    def __init__(self) -> None:
        self._counters: dict[str, itertools.count] = collections.defaultdict(itertools.count)

    def pick(self, candidates, prompt_tokens):
        ordered = sorted(candidates, key=lambda w: w.worker_id)
        return ordered[next(self._counters[ordered[0].role]) % len(ordered)]


class LeastLoaded(Policy):
    """Fewest requests (running + waiting + routed since the last heartbeat), then
    fewest queued prefill tokens, then the most free KV blocks."""

    name = "least_loaded"

    def pick(self, candidates, prompt_tokens):
        return min(candidates, key=lambda w: (
            w.load, w.queued_prefill_tokens + w.pending_tokens, -w.free_blocks, w.worker_id))


POLICIES = {p.name: p for p in (RoundRobin, LeastLoaded)}


def make_policy(name: str) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; choose from {sorted(POLICIES)}")
    return POLICIES[name]()


def decide(workers: list[WorkerView], policy: Policy, *, model: str, prompt_tokens: int,
           cached_tokens: int = 0, disagg_threshold: int = 256,
           exclude: frozenset[str] = frozenset()) -> Decision:
    usable = [w for w in workers if w.alive and w.worker_id not in exclude
              and (not model or w.model == model)]
    decoders = [w for w in usable if w.role in ("decode", "unified")]
    if not decoders:
        raise NoWorkers("no live decode or unified worker")
    decode = policy.pick(decoders, prompt_tokens)
    if decode.role == "unified":
        return Decision(decode, None, "colocated")
    uncached = prompt_tokens - cached_tokens
    if uncached < disagg_threshold:
        return Decision(decode, None, f"short prompt ({uncached} < {disagg_threshold})")
    prefillers = [w for w in usable if w.role == "prefill"
                  and w.fingerprint == decode.fingerprint]
    if not prefillers:
        return Decision(decode, None, "no prefill worker")
    return Decision(decode, policy.pick(prefillers, prompt_tokens), "disaggregated")


def account(decision: Decision, prompt_tokens: int) -> None:
    """Count a decision against its workers until their next heartbeat."""
    decision.decode.pending_requests += 1
    if decision.prefill is not None:
        decision.prefill.pending_requests += 1
        decision.prefill.pending_tokens += prompt_tokens
    else:
        decision.decode.pending_tokens += prompt_tokens
