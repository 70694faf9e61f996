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
one place.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.protocol import ConductorStats
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
        return Projection(n, self.waiting / n, kv, ttft, tbt)


def role_loads(stats: ConductorStats, model: str = "") -> dict[str, RoleLoad]:
    """Each scaled role's load over its live workers (of ``model`` if given)."""
    cost = CostModel(stats.cost_model)
    out = {}
    for role in ROLES:
        live = [w for w in stats.workers if w.alive and w.info.role == role
                and (not model or w.info.model == model)]
        total_blocks = sum(w.info.num_blocks for w in live)
        out[role] = RoleLoad(
            role=role, alive=len(live), waiting=sum(w.waiting for w in live),
            running=sum(w.running for w in live),
            queued_prefill_tokens=sum(w.queued_prefill_tokens for w in live),
            used_blocks=sum(max(0, w.info.num_blocks - w.free_blocks) for w in live),
            blocks_per_worker=total_blocks // len(live) if live else 0,
            block_size=live[0].info.block_size if live else 0, cost=cost)
    return out
