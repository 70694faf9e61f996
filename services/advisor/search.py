"""The deployments of N workers and how each serves a workload, on the simulator.

For N workers: colocated (N unified workers, every prompt prefilled where it decodes)
and every split P prefill + (N - P) decode, P = 1 .. N-1; each with and without a cache
pool (when the profile gives a pool bandwidth). Each is one ``Simulator`` run under the
conductor's own ``Router``, built from the ``ConductorSettings`` the written config
holds (``Plan.conductor_settings``), so the routing simulated is the routing deployed.

A request is *good* when it completes with TTFT <= the TTFT SLO and TPOT (its mean time
per output token after the first) <= the TPOT SLO; goodput is good requests per second
from the first arrival to the last completion, as ``bench/serve.py`` measures it live.
Ranking: goodput, then p90 TTFT, then fewer processes of different kinds (colocated
first, then fewer prefill workers, then no pool): the simpler of two equals wins.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

from common.cost_profile import load_profile
from services.conductor.router import Router, RouteRequest
from services.conductor.server import ConductorSettings
from services.sim.profiles import Profile
from services.sim.request import SimRequest
from services.sim.simulator import Simulator, percentile

MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError(f"SLOs must be > 0 s, got TTFT {self.ttft_s}, TPOT {self.tpot_s}")


@dataclass(frozen=True, slots=True)
class Deployment:
    prefill: int  # 0: colocated (unified workers)
    decode: int
    pool: bool

    @property
    def colocated(self) -> bool:
        return self.prefill == 0

    @property
    def name(self) -> str:
        base = f"colocated x{self.decode}" if self.colocated else \
            f"{self.prefill}P+{self.decode}D"
        return base + (" +pool" if self.pool else "")


def deployments(workers: int, *, pool: bool) -> list[Deployment]:
    """Colocated and every P:D split of ``workers``; with pool variants if ``pool``."""
    if workers < 1:
        raise ValueError(f"need at least 1 worker, got {workers}")
    splits = [(0, workers)] + [(p, workers - p) for p in range(1, workers)]
    return [Deployment(p, d, with_pool) for p, d in splits
            for with_pool in ((False, True) if pool else (False,))]


@dataclass(frozen=True, slots=True)
class Plan:
    """What every simulated deployment shares: costs, memory, routing settings."""

    profile_spec: str  # a name in deploy/profiles or a path, as the conductor loads it
    profile: Profile  # the simulated worker: costs, KV blocks of the workload's block
    slo: Slo
    kv_cache_mib: int
    pool_mib: int = 1024  # the cache pool's DRAM tier
    admission: bool = False  # write the SLOs as the conductor's defaults: reject early
    kv_lease_s: float = 10.0
    noise: float = 0.0
    seed: int = 0
    shared_host: bool = False  # all workers on one host: the profile's contention applies

    def conductor_settings(self, dep: Deployment) -> ConductorSettings:
        slo = {"slo_ttft_ms": self.slo.ttft_s * 1e3, "slo_tbt_ms": self.slo.tpot_s * 1e3} \
            if self.admission else {}
        return ConductorSettings(policy="cache_aware", cost_profile=self.profile_spec,
                                 admission=self.admission, **slo)

    def pool_blocks(self) -> int:
        return (self.pool_mib * MIB) // self.profile.block_bytes


@dataclass(frozen=True, slots=True)
class Outcome:
    deployment: Deployment
    requests: int
    completed: int
    good: int
    rejected: int
    goodput_rps: float
    ttft_s: dict[str, float] = field(default_factory=dict)  # p50, p90, p99, mean
    tpot_s: dict[str, float] = field(default_factory=dict)
    local_prefills: int = 0
    cached_frac: float = 0.0
    goodput_runs: tuple[float, ...] = ()  # every run's goodput, low to high (search runs>1)

    @property
    def good_frac(self) -> float:
        return self.good / self.requests

    def rank_key(self) -> tuple:
        d = self.deployment
        p90 = self.ttft_s.get("p90", math.inf)
        return (-round(self.goodput_rps, 9), math.inf if math.isnan(p90) else p90,
                d.prefill, d.pool)


def _summary(values: list[float]) -> dict[str, float]:
    mean = sum(values) / len(values) if values else math.nan
    return {"mean": mean, **{f"p{q}": percentile(values, q) for q in (50, 90, 99)}}


def evaluate(dep: Deployment, reqs: list[SimRequest], plan: Plan,
             decisions: dict[str, str] | None = None, steps: list | None = None) -> Outcome:
    """One simulated run of ``reqs`` (fresh records; filled in) on ``dep``; with
    ``decisions``, each request's routing reason is put there by its id, as the live
    conductor logs it (``routed ... reason=``); with ``steps``, the workers' step
    samples (``Simulator(steps=...)``)."""
    settings = plan.conductor_settings(dep)
    router = Router(settings.router_config(), load_profile(plan.profile_spec))

    def route(views, req):
        # With its id, as the gateway asks the live conductor: counted in flight until a
        # heartbeat acknowledges it, its predicted TTFT kept for the TTFT correction.
        decision = router.route(views, RouteRequest("sim", req.prompt, req.hashes,
                                                    max_tokens=req.output),
                                req.request_id, now=req.arrival)
        if decisions is not None:
            decisions[req.request_id] = decision.reason
        return decision
    Simulator(plan.profile, route, prefill=dep.prefill, decode=dep.decode,
              index=router.index, cost=router.cost,
              pool_blocks=plan.pool_blocks() if dep.pool else 0,
              kv_lease_s=plan.kv_lease_s, noise=plan.noise, seed=plan.seed,
              shared_host=plan.shared_host,
              correction=router.correction if settings.ttft_correction else None,
              steps=steps).run(reqs)
    done = [r for r in reqs if r.done is not None]
    good = sum(1 for r in done if r.ttft <= plan.slo.ttft_s and r.tbt <= plan.slo.tpot_s)
    start = min(r.arrival for r in reqs)
    span = max((r.done for r in done), default=start) - start
    return Outcome(
        dep, len(reqs), len(done), good, sum(1 for r in reqs if r.rejected),
        good / span if span > 0 else 0.0,
        _summary([r.ttft for r in done]), _summary([r.tbt for r in done if r.output > 1]),
        sum(1 for r in done if r.prefill_id is None),
        sum(r.cached for r in done) / max(1, sum(r.prompt for r in done)))


def search(candidates: list[Deployment], make_requests: Callable[[], list[SimRequest]],
           plan: Plan, progress: Callable[[Deployment], None] | None = None,
           runs: int = 1) -> list[Outcome]:
    """Every candidate simulated on fresh requests, best first (see ``rank_key``). With
    ``runs`` > 1, each is run that many times, seeds ``plan.seed`` on (draws of the
    plan's noise), and stands for its run of median goodput (the lower middle one for an
    even count), every run's goodput in ``goodput_runs``: near overload one run is one
    draw of a wide spread (a few percent on a step moves which requests a prefill
    interrupts and where the next ones are routed)."""
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    outcomes = []
    for dep in candidates:
        draws = sorted((evaluate(dep, make_requests(), replace(plan, seed=plan.seed + k))
                        for k in range(runs)), key=lambda o: o.goodput_rps)
        median = draws[(runs - 1) // 2]
        outcomes.append(replace(median, goodput_runs=tuple(o.goodput_rps for o in draws))
                        if runs > 1 else median)
        if progress is not None:
            progress(dep)
    return sorted(outcomes, key=Outcome.rank_key)


def splits(outcomes: list[Outcome], *, pool: bool) -> Iterator[Outcome]:
    """The outcomes with or without the pool, by number of prefill workers."""
    yield from sorted((o for o in outcomes if o.deployment.pool == pool),
                      key=lambda o: o.deployment.prefill)
