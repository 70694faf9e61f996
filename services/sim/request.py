"""One simulated request and what a simulated worker may use of its simulator."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from services.conductor.prefix_index import PrefixIndex
from services.sim.kv_blocks import PoolTier
from services.sim.profiles import Profile


@dataclass(slots=True)
class SimRequest:
    rid: int
    arrival: float
    prompt: int
    output: int  # tokens, the first one from prefill
    hashes: list[int]
    decode_id: str = ""
    prefill_id: str | None = None  # None: prefilled on its decode worker
    routed_prefill: str | None = None  # the route's prefill worker (None: local)
    fell_back: bool = False  # routed remote, prefilled on its decode worker
    cached: int = 0
    decode_hit: int = 0  # blocks its decode worker held when it reserved them
    fetch: int = 0  # pool blocks fetched for a local prefill
    first_token: float | None = None
    done: float | None = None
    rejected: str = ""  # "", "arrival", "prefill" or "decode"

    @property
    def request_id(self) -> str:
        """The id a route gives the conductor and heartbeats acknowledge."""
        return str(self.rid)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tbt(self) -> float | None:
        if self.done is None:
            return None
        return (self.done - self.first_token) / (self.output - 1) if self.output > 1 else 0.0


class SimContext(Protocol):
    """The simulator as its workers see it (``Simulator`` is one)."""

    profile: Profile
    index: PrefixIndex
    pool: PoolTier | None
    workers: dict
    kv_lease_s: float
    stage_reject_wait_s: float | None
    token_overhead_s: float

    def push(self, t: float, fn: Callable, arg: object = None) -> None: ...
    def finish(self, req: SimRequest, rejected: str, now: float | None = None) -> None: ...
    def prefill_s(self, n: int, c: int) -> float: ...
    def stage_reject(self, req: SimRequest, now: float) -> str: ...
    def jitter(self) -> float: ...
    def contention(self, worker: object, kind: str = "") -> float: ...
