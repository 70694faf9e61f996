"""The routing policy interface: what every policy the conductor can run promises.

    RoutingPolicy.decide(workers, PolicyRequest) -> Decision | Rejection

The router holds one ``RoutingPolicy`` and calls it the same way whatever the policy;
the simulator and the tests drive the same objects. Implementations live beside this
file and import it: ``policy.py`` (the baselines: a worker picker under the static
disaggregation rule) and ``cache_policy.py`` (cache- and load-aware); ``router.py``
builds one from its configuration.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import NamedTuple

from services.conductor.registry import WorkerView


class NoWorkers(RuntimeError):
    """No live worker can serve this request."""


class Decision(NamedTuple):
    decode: WorkerView
    prefill: WorkerView | None  # None: the decode worker prefills the prompt itself
    reason: str
    # The TTFT predicted before any learned correction (NaN: this policy predicts none).
    predicted_ttft_s: float = math.nan


class Rejection(NamedTuple):
    reason: str
    retry_after_s: float


class PolicyRequest(NamedTuple):
    """One request as a policy sees it, every default already resolved.

    ``block_hashes`` is the prompt's chain in blocks of ``block_size`` tokens (the prefix
    index's block size, not the workers' paging block). Infinite SLOs mean none;
    ``output_tokens`` is the output the policy plans KV and TBT for (0: unknown);
    ``admission=False`` never rejects."""

    prompt_tokens: int
    block_hashes: Sequence[int] = ()
    block_size: int = 16
    model: str = ""  # "": any model
    exclude: frozenset[str] = frozenset()
    slo_ttft_s: float = math.inf
    slo_tbt_s: float = math.inf
    output_tokens: int = 0
    admission: bool = True
    # With an id, the decision stays counted on its workers until their heartbeats
    # acknowledge it (``WorkerView.route``); routed_at is when (monotonic seconds).
    request_id: str = ""
    routed_at: float = 0.0


class RoutingPolicy(ABC):
    """Chooses, for one request, a decode worker and either a prefill worker or local
    prefill, or rejects the request.

    Contract:

    * pure: worker views and the request in, a decision out; no I/O, no clock, no
      randomness beyond the policy's own seeded state, so the conductor, the simulator
      and the tests get the same answer from the same inputs;
    * only live workers of the request's model (any model for ``""``), not in
      ``exclude``, are chosen; a prefill worker has the decode worker's fingerprint;
    * an accepted decision is accounted by the policy itself against the views' in-flight
      counters (``pending_requests``, ``pending_tokens``), which the worker's
      heartbeats clear (``Registry.heartbeat``); a ``Rejection`` accounts nothing;
    * raises ``NoWorkers`` when no live decode or unified worker is left, ``ValueError``
      for a request with bad sizes.
    """

    name: str

    @abstractmethod
    def decide(self, workers: list[WorkerView], request: PolicyRequest) -> Decision | Rejection:
        """Route one request and account it; see the class docstring."""


def candidates(workers: list[WorkerView],
               request: PolicyRequest) -> tuple[list[WorkerView], list[WorkerView]]:
    """(every usable worker, the decode and unified ones among them) for ``request``;
    ``NoWorkers`` when the second list would be empty."""
    usable = [w for w in workers if w.alive and w.worker_id not in request.exclude
              and (not request.model or w.model == request.model)]
    decoders = [w for w in usable if w.role in ("decode", "unified")]
    if not decoders:
        raise NoWorkers("no live decode or unified worker")
    return usable, decoders
