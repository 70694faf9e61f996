"""The conductor's routing, without I/O: which policy, with which cost model and prefix
index, under which SLOs. The conductor process feeds it heartbeats and asks it for
decisions; tests and the simulator drive the same object with the same inputs.

    RouteRequest(model, prompt_len, block hashes, SLOs, max_tokens)
        │ defaults resolved into a PolicyRequest
        ▼
    RoutingPolicy.decide (routing_policy.py), one object chosen at start by name:
        "cache_aware": CacheAwarePolicy (predicted TTFT/TBT, conditional
                       disaggregation, SLO admission)
        "round_robin" / "least_loaded": StaticDisaggregation over that picker, with
                       the static disaggregation threshold; never rejects
        ▼
    Decision (decode worker, prefill worker or local, reason) | Rejection (reason, retry)

SLOs: a request's own (``RouteRequest.slo_*``) else the configured defaults; infinite
means none. Admission only rejects against a finite SLO. ``max_tokens`` is an upper
bound; the policy plans KV and TBT for ``min(max_tokens, planned_output_tokens)``.
The prefix index's block size is the live workers' (the profile's when none is live).

Online fit: ``observe`` feeds the step samples a heartbeat carries into the cost model
(prefill steps and decode steps; a malformed sample is skipped and counted), and
``observe_ttft`` a decode worker's first-token times into the TTFT correction
(``ttft_correction.py``), against what ``route`` predicted for the same request id.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from common.cost_profile import CostProfile
from common.protocol import StepSample, TtftSample
from common.records import CostCoefficients
from services.conductor.cache_policy import CacheAwarePolicy, PolicyConfig
from services.conductor.contention import busy_by_host, busy_on_host
from services.conductor.cost_model import CostModel
from services.conductor.policy import PICKERS, StaticDisaggregation, make_picker
from services.conductor.prefix_index import PrefixIndex
from services.conductor.registry import WorkerView, is_count, is_finite_time
from services.conductor.routing_policy import Decision, PolicyRequest, Rejection, RoutingPolicy
from services.conductor.ttft_correction import CorrectionConfig, Expected, TtftCorrection

ROUTING_POLICIES = ("cache_aware", *sorted(PICKERS))


@dataclass(frozen=True, slots=True)
class RouterConfig:
    policy: str = "cache_aware"
    disagg_threshold: int = 256  # static rule of the baseline policies
    slo_ttft_s: float = math.inf  # defaults for requests that name none
    slo_tbt_s: float = math.inf
    admission: bool = True
    max_decode_stall_s: float = 0.5
    planned_output_tokens: int = 512
    kv_lease_s: float = 10.0  # the workers' KV lease (cache_aware)
    correction: CorrectionConfig = CorrectionConfig()  # learned TTFT factor (cache_aware)

    def __post_init__(self) -> None:
        if self.policy not in ROUTING_POLICIES:
            raise ValueError(f"unknown routing policy {self.policy!r}; choose from "
                             f"{list(ROUTING_POLICIES)}")
        if not (self.slo_ttft_s > 0 and self.slo_tbt_s > 0):
            raise ValueError("SLOs must be > 0 seconds (math.inf: none)")
        if self.planned_output_tokens < 1 or self.disagg_threshold < 0:
            raise ValueError("planned_output_tokens must be >= 1, disagg_threshold >= 0")


class RouteRequest(NamedTuple):
    model: str
    prompt_len: int
    block_hashes: Sequence[int] = ()
    exclude: frozenset[str] = frozenset()
    slo_ttft_s: float | None = None  # None: the configured default
    slo_tbt_s: float | None = None
    max_tokens: int = 0  # 0: unknown


def make_policy(config: RouterConfig, profile: CostProfile, index: PrefixIndex,
                cost: CostModel, correction: TtftCorrection | None = None) -> RoutingPolicy:
    """The policy ``config.policy`` names, reading ``index``, ``cost`` and
    ``correction``."""
    if config.policy == "cache_aware":
        return CacheAwarePolicy(index, cost, PolicyConfig(
            profile.kv_bytes_per_token, profile.link_bandwidth, profile.pool_bandwidth,
            config.max_decode_stall_s, config.kv_lease_s,
            # Profiles that measured their host carry it (older ones do not).
            tuple(getattr(profile, "contention", ()))), correction)
    return StaticDisaggregation(make_picker(config.policy), config.disagg_threshold)


class Router:
    """Routes requests through one ``RoutingPolicy``: the one ``config.policy`` names,
    or ``policy`` when given (a policy of one's own; ``config.policy`` is then unused)."""

    def __init__(self, config: RouterConfig, profile: CostProfile,
                 index: PrefixIndex | None = None, *,
                 policy: RoutingPolicy | None = None) -> None:
        self.config = config
        self.profile = profile
        self.index = PrefixIndex() if index is None else index
        # In one-worker-alone units: samples are divided by their host's factor.
        self.cost = CostModel(CostCoefficients(*profile.coefficients()),
                              contention=tuple(getattr(profile, "contention", ())))
        self.bad_samples = 0
        self.correction = TtftCorrection(config.correction)
        self.policy = (make_policy(config, profile, self.index, self.cost, self.correction)
                       if policy is None else policy)

    @property
    def name(self) -> str:
        return self.policy.name

    def route(self, workers: list[WorkerView], req: RouteRequest,
              request_id: str | None = None, *, now: float | None = None) -> Decision | Rejection:
        """Decide for one request and account it against the chosen workers; with a
        ``request_id``, remember the TTFT predicted for it (``observe_ttft``); ``now``
        is the clock its in-flight entry is stamped with (a simulator's). Raises
        ``NoWorkers`` when no live decode or unified worker serves the model,
        ``ValueError`` for a request with no prompt or negative ``max_tokens``."""
        if req.prompt_len <= 0 or req.max_tokens < 0:
            raise ValueError(f"bad request: prompt_len {req.prompt_len}, "
                             f"max_tokens {req.max_tokens}")
        cfg = self.config
        block_size = next((w.block_size for w in workers if w.alive), self.profile.block_size)
        output = min(req.max_tokens, cfg.planned_output_tokens) if req.max_tokens else 0
        decision = self.policy.decide(workers, PolicyRequest(
            prompt_tokens=req.prompt_len, block_hashes=req.block_hashes,
            block_size=block_size, model=req.model, exclude=req.exclude,
            slo_ttft_s=cfg.slo_ttft_s if req.slo_ttft_s is None else req.slo_ttft_s,
            slo_tbt_s=cfg.slo_tbt_s if req.slo_tbt_s is None else req.slo_tbt_s,
            output_tokens=output, admission=cfg.admission, request_id=request_id or "",
            routed_at=(time.monotonic() if now is None else now) if request_id else 0.0))
        if request_id and isinstance(decision, Decision):
            self.correction.expect(request_id, Expected(
                decision.decode.worker_id,
                decision.prefill.worker_id if decision.prefill is not None else None,
                decision.predicted_ttft_s))
        return decision

    def observe_ttft(self, worker_id: str, samples: Sequence[TtftSample]) -> int:
        """Learn from decode worker ``worker_id``'s first-token times; returns how many
        matched a request routed to it (the rest are counted as unmatched)."""
        return self.correction.observe(worker_id, samples)

    def observe(self, prefill_steps: Sequence[StepSample],
                decode_steps: Sequence[StepSample], worker_id: str = "",
                workers: Sequence[WorkerView] = ()) -> int:
        """Fit the cost model on a heartbeat's step samples of worker ``worker_id``, its
        host's busy workers counted among ``workers`` (``reporting_busy``); returns how
        many were used (``fit_step_samples``; the senseless ones are counted in
        ``bad_samples``)."""
        used, bad = fit_step_samples(self.cost, prefill_steps, decode_steps,
                                     reporting_busy(workers, worker_id))
        self.bad_samples += bad
        return used


def reporting_busy(workers: Sequence[WorkerView], worker_id: str) -> int:
    """The workers busy on ``worker_id``'s host, it counted, as the policy counts them
    (``contention.py``), at the heartbeat that brings its step samples: a sample carries
    no count of its own time, and this one, taken after the heartbeat updated the
    worker's view, is the nearest to when its steps ran. 1 for a worker not listed."""
    w = next((v for v in workers if v.worker_id == worker_id), None)
    return 1 if w is None else busy_on_host(busy_by_host(workers), w)


def fit_step_samples(cost: CostModel, prefill_steps: Sequence[StepSample],
                     decode_steps: Sequence[StepSample], busy: int = 1) -> tuple[int, int]:
    """Fit ``cost`` on a heartbeat's step samples, as the conductor and the simulator do,
    run with ``busy`` workers busy on the reporting worker's host (``reporting_busy``);
    returns (used, skipped). A sample whose values make no sense (counts that are not
    ints >= 0, chunk lists of different lengths, a time that is not finite) is skipped:
    the codec checks types, but a record built in process is not."""
    used = bad = 0
    for s in prefill_steps:
        try:
            chunks = list(zip(s.tokens, s.cached, strict=True))
            if not all(is_count(n) and is_count(c) for n, c in chunks):
                raise ValueError("token counts must be ints >= 0")
            cost.observe_prefill_step(chunks, _seconds(s.seconds), busy)
            used += 1
        except (TypeError, ValueError):
            bad += 1
    for s in decode_steps:
        try:
            if not (is_count(s.batch) and is_count(s.context)):
                raise ValueError("batch and context must be ints >= 0")
            cost.observe_decode(s.batch, s.context, _seconds(s.seconds), busy)
            used += 1
        except (TypeError, ValueError):
            bad += 1
    return used, bad


def _seconds(v) -> float:
    if not is_finite_time(v):
        raise ValueError(f"seconds must be a finite number >= 0, got {v!r}")
    return float(v)
