"""A role's load as the conductor sees it, and what it predicts for one worker more or less.

From ConductorStats (the workers' last heartbeats and the conductor's fitted cost model)::

    queue   waiting requests per live worker
    kv      KV blocks in use over the role's blocks
    ttft    a prefill worker's queue drained at the fitted prefill cost, the role's
            queued prompts spread evenly (``CostModel.prefill_queue_time``)
    tbt     one decode step of the role's running sequences and their KV spread evenly
            (``CostModel.predict_decode``)

``at(n)`` projects the same work onto ``n`` workers: the policy scales out on the load at
the current size and scales in only when the load at one worker fewer would still be low.
The cost formula is the conductor's (``services/conductor/cost_model.py``): one formula,
one place. That model predicts a worker alone on its host; workers that share a host's
cores slow each other (``services/conductor/contention.py``), so both predictions are
multiplied by the host factor for the workers that would be busy there: the busiest of
the role's hosts keeps its other busy workers and gets its share of the ``n``.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.protocol import ConductorStats
from services.conductor.contention import host_factor
from services.conductor.cost_model import CostModel

ROLES = ("prefill", "decode")


@dataclass(frozen=True, slots=True)
class Projection:
    """The role's load per worker if ``workers`` workers shared it."""

    workers: int
    queue: float  # waiting requests per worker
    kv: float  # fraction of KV blocks in use
    ttft_s: float  # predicted queueing before a new prompt's prefill starts
    tbt_s: float  # predicted decode step


@dataclass(frozen=True, slots=True)
class RoleLoad:
    role: str
    alive: int
    waiting: int
    running: int
    queued_prefill_tokens: int
    used_blocks: int
    blocks_per_worker: int
    block_size: int
    cost: CostModel | None = None  # None: no prediction (no cost model known)
    contention: tuple[float, ...] = ()  # the profile's host factors (none: not measured)
    hosts: int = 1  # hosts the role's live workers run on
    others_busy: int = 0  # busy workers not of the role on the busiest of those hosts

    def host_factor(self, workers: int) -> float:
        """The step factor with the role's work on ``workers`` workers: their share on
        one host (spread evenly over its hosts) beside the other workers busy there."""
        if not (self.waiting or self.running or self.queued_prefill_tokens):
            return 1.0
        return host_factor(self.contention, self.others_busy + -(-workers // self.hosts))

    def at(self, workers: int) -> Projection:
        """The load spread over ``workers`` workers (at least one)."""
        n = max(1, workers)
        blocks = self.blocks_per_worker * n
        kv = self.used_blocks / blocks if blocks else 0.0
        ttft = tbt = 0.0
        if self.cost is not None:
            ttft = self.cost.prefill_queue_time(round(self.waiting / n),
                                                round(self.queued_prefill_tokens / n))
            batch = -(-self.running // n)
            tbt = self.cost.predict_decode(batch, round(self.used_blocks * self.block_size / n))
            factor = self.host_factor(n)
            ttft, tbt = ttft * factor, tbt * factor
        return Projection(n, self.waiting / n, kv, ttft, tbt)


def role_loads(stats: ConductorStats, model: str = "") -> dict[str, RoleLoad]:
    """Each scaled role's load over its live workers (of ``model`` if given)."""
    cost = CostModel(stats.cost_model)
    busy: dict[str, set[str]] = {}  # host id: its busy workers, every role and model
    for w in stats.workers:
        if w.alive and (w.running or w.waiting or w.queued_prefill_tokens):
            busy.setdefault(w.info.host_id, set()).add(w.info.worker_id)
    out = {}
    for role in ROLES:
        live = [w for w in stats.workers if w.alive and w.info.role == role
                and (not model or w.info.model == model)]
        hosts, ids = {w.info.host_id for w in live}, {w.info.worker_id for w in live}
        total_blocks = sum(w.info.num_blocks for w in live)
        out[role] = RoleLoad(
            role=role, alive=len(live), waiting=sum(w.waiting for w in live),
            running=sum(w.running for w in live),
            queued_prefill_tokens=sum(w.queued_prefill_tokens for w in live),
            used_blocks=sum(max(0, w.info.num_blocks - w.free_blocks) for w in live),
            blocks_per_worker=total_blocks // len(live) if live else 0,
            block_size=live[0].info.block_size if live else 0, cost=cost,
            contention=tuple(stats.contention), hosts=max(1, len(hosts)),
            others_busy=max((len(busy.get(h, set()) - ids) for h in hosts), default=0))
    return out
