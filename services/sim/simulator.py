r"""An offline discrete-event simulator of a prefill/decode cluster that drives the
conductor's own policy objects over a whole trace in seconds, under the rules the live
workers follow (services/sim/workers.py):

    arrival --route()--> Rejection                                  (rejected "arrival")
                     \-> Decision
      remote: decode reserves the blocks between its steps (else prefills locally)
              --> prefill FIFO
              --prefill--> link FIFO --KV of the blocks decode lacks--> joins the batch
              (the KV lease runs out first: blocks freed, prefilled locally)
      local:  decode queue (until its blocks fit) --> prefill on the decode worker, in
              one step with its batch's decode (the prompts that fit the step's token
              budget together) --> joins the batch
      batch: output-1 steps --> done; its blocks freed and still cached

* Every worker's prefix cache is its own KV blocks (``kv_blocks``, services/sim/kv_blocks.py),
  blocks of running requests included and evicted LRU once free, as the engine keeps
  them; no other cache. ``pool_blocks`` > 0 adds the pool's DRAM tier, a separate
  location that prefill writes back to and any worker fetches from at ``pool_bandwidth``.
* Decode workers batch continuously; a step of B sequences holding K tokens takes
  ``profile.decode_step_s(B, K)`` (the calibration's measured steps where it has
  them: ``Profile.decode_shape``). Between batch changes step times form an arithmetic
  series (K grows by B a step), so the simulator jumps between changes in closed form.
* Costs are a profile file's (``Profile.load``), times a lognormal factor of
  ``noise`` (sigma; mean 1) per prefill and per run of decode steps.
* ``shared_host``: every worker runs on one host and shares its cores, as on a small
  machine: each prefill and each run of decode steps is slowed by the profile's
  ``contention`` factor for the processes busy when it starts, and every decode step
  costs ``token_overhead_s`` more per sequence. Busy: the workers busy, and the serving
  processes (gateway, conductor, clients) as the share of a core their streaming takes
  (``serving_load``): they wait on sockets but for the tokens they pass on, so they are
  no whole busy process (counted as one, a prefill beside them took the three-process
  factor that live prefills do not pay); the factor is linear between whole numbers.
  The policy then sees every worker on one host (one ``host_id``), as live, so it
  applies the conductor's profile's contention factors to its predictions (the
  simulator's own ``profile`` decides what the work really takes: a profile without
  ``contention`` models workers that do not slow each other, as ``--executor sim``).
* Caches publish ``stored``/``removed`` to the prefix index at once (KV events); load
  and step timings reach the policy only in heartbeats every ``heartbeat_s`` through
  ``Registry`` and the conductor's sample fitting, so the policy sees stale counters
  plus its own in-flight accounting, and a duration only after the work ran, divided
  by the contention factor of its host's busy workers at that heartbeat as the policy
  counts them (``router.reporting_busy``), the cost model's units being one worker's.
  Heartbeats acknowledge the requests taken in (``Heartbeat.admitted``), so a route
  that passes the request's id (``SimRequest.request_id``, routed at ``arrival``)
  gets the conductor's per-request in-flight accounting; decode workers' first-token
  times reach ``correction`` (the router's ``TtftCorrection``) when one is given.
* TTFT = arrival to the first token at the decode worker (KV landed, or the local
  prefill done); TBT = (done - first token) / (output - 1), the request's mean.
* ``stage_reject_wait_s`` turns on per-stage rejection: at a prefill worker whose queue
  holds more than that many seconds of work when the request's Prefill reaches it, and
  at a decode worker that cannot reserve the request's blocks (instead of prefilling it
  locally); both when the decode worker takes the request in, between its steps.
"""

from __future__ import annotations

import heapq
import json
import math
import random
from collections.abc import Callable

from common.protocol import WorkerInfo
from services.conductor.cache_policy import Rejection
from services.conductor.cost_model import CostModel
from services.conductor.prefix_index import PrefixIndex
from services.conductor.registry import Registry, WorkerView
from services.conductor.router import fit_step_samples, reporting_busy
from services.conductor.ttft_correction import TtftCorrection
from services.sim.kv_blocks import PoolTier
from services.sim.prefill_worker import PrefillWorker
from services.sim.profiles import Profile
from services.sim.request import SimRequest
from services.sim.workers import DecodeWorker


def load_trace(path: str, *, speed: float = 1.0, limit: int | None = None) -> list[SimRequest]:
    """Mooncake JSONL (timestamp ms, input_length, output_length, hash_ids); ``speed`` > 1
    compresses time."""
    if speed <= 0:
        raise ValueError(f"speed must be > 0, got {speed}")
    with open(path) as f:
        rows = [json.loads(line) for i, line in enumerate(f) if limit is None or i < limit]
    return [SimRequest(i, r["timestamp"] / 1000 / speed, int(r["input_length"]),
                       max(1, int(r["output_length"])), list(r["hash_ids"]))
            for i, r in enumerate(rows)]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile; NaN for no values."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))] if s else math.nan


Router = Callable[[list[WorkerView], SimRequest], object]  # -> Decision | Rejection


class Simulator:
    """One run: ``Simulator(...).run(requests)`` fills in every request's outcome."""

    def __init__(self, profile: Profile, route: Router, *, prefill: int, decode: int,
                 index: PrefixIndex | None = None, cost: CostModel | None = None,
                 heartbeat_s: float = 1.0, pool_blocks: int = 0,
                 stage_reject_wait_s: float | None = None, kv_lease_s: float = 10.0,
                 noise: float = 0.0, seed: int = 0, shared_host: bool = False,
                 correction: TtftCorrection | None = None,
                 steps: list | None = None) -> None:
        if decode <= 0 or prefill < 0 or heartbeat_s <= 0:
            raise ValueError("need decode >= 1, prefill >= 0 workers and heartbeat_s > 0")
        if pool_blocks and profile.pool_bandwidth <= 0:
            raise ValueError("a pool tier needs profile.pool_bandwidth > 0")
        if not kv_lease_s > 0 or not 0 <= noise < 2:
            raise ValueError("need kv_lease_s > 0 and 0 <= noise < 2")
        self.profile, self.route, self.cost = profile, route, cost
        self.index = PrefixIndex() if index is None else index
        self.heartbeat_s, self.stage_reject_wait_s = heartbeat_s, stage_reject_wait_s
        self.kv_lease_s, self.noise, self._rng = kv_lease_s, noise, random.Random(seed)
        self.shared_host, self.correction = shared_host, correction
        self.arrived = self.total = 0
        self.token_overhead_s = profile.token_overhead_s if shared_host else 0.0
        self.pool = PoolTier(pool_blocks, self.index) if pool_blocks else None
        self.registry = Registry(heartbeat_s)
        self.workers: dict[str, PrefillWorker | DecodeWorker] = {}
        for role, cls, count in (("prefill", PrefillWorker, prefill),
                                 ("decode", DecodeWorker, decode)):
            for i in range(count):
                wid = f"{role}-{i}"
                self.workers[wid] = cls(self, wid)
                self.registry.workers[wid] = WorkerView(WorkerInfo(
                    worker_id=wid, role=role, model="sim", control_addr="", kv_addr="",
                    host_id="host" if shared_host else wid, block_size=profile.block_size,
                    num_blocks=profile.kv_blocks,
                    fingerprint=profile.name), last_seen=0.0, free_blocks=profile.kv_blocks)
        self.views = list(self.registry.workers.values())
        self._heap: list = []
        self._seq = self.open = 0
        self.bad_samples = 0
        # With a list: every step sample the workers report, as (worker id, "prefill" or
        # "decode", StepSample), to hold against a live worker's step trace.
        self.steps = steps

    def jitter(self) -> float:
        """A lognormal factor of mean 1 (1.0 without noise)."""
        if not self.noise:
            return 1.0
        return math.exp(self._rng.gauss(-self.noise ** 2 / 2, self.noise))

    def contention(self, worker: object, kind: str = "") -> float:
        """The step factor for ``worker`` starting work of ``kind`` ("decode" or
        "prefill") now: 1.0 unless the workers share one host, else the profile's for it
        and the others busy at this moment, each weighted by what it runs
        (``Profile.weight``: a neighbour's long prefill slows a decode step less than
        its decode does)."""
        if not self.shared_host:
            return 1.0
        prof = self.profile
        return prof.contended(
            1 + sum(prof.weight(kind, w.running()) for w in self.workers.values()
                    if w is not worker and w.busy) + self.serving_load(), kind)

    def serving_load(self) -> float:
        """The share of a core the serving processes (gateway, conductor, clients) take
        now: they wait on sockets but for the tokens they pass on, each costing about
        the ``token_overhead_s`` the profile measured on a free core, at the rate the
        decode batches stream them (at most one core)."""
        if not self.token_overhead_s:
            return 0.0
        rate = sum(w.B / w.step_s() for w in self.workers.values()
                   if isinstance(w, DecodeWorker) and w.B)
        return min(1.0, rate * self.token_overhead_s)

    def stage_reject(self, req: SimRequest, now: float) -> str:
        """"prefill" when per-stage rejection is on and ``req``'s prefill worker has more
        than ``stage_reject_wait_s`` of work ahead as its Prefill reaches it, else ""."""
        w = self.stage_reject_wait_s
        return "prefill" if w is not None and self.workers[req.prefill_id].wait_s(now) > w \
            else ""

    def prefill_s(self, n: int, c: int) -> float:
        return self.profile.prefill_s(n, c) * self.jitter()

    def push(self, t: float, fn: Callable, arg: object = None) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn, arg))

    def finish(self, req: SimRequest, rejected: str, now: float | None = None) -> None:
        req.rejected, req.done = rejected, now
        self.open -= 1

    def run(self, requests: list[SimRequest]) -> list[SimRequest]:
        cap, bs = self.profile.kv_blocks, self.profile.block_size
        for req in requests:
            if max(len(req.hashes), -(-(req.prompt + req.output) // bs)) > cap:
                raise ValueError(f"request {req.rid} needs more than the {cap} KV blocks "
                                 "of a decode worker")
            self.push(req.arrival, self._arrive, req)
        self.open = self.total = len(requests)
        self.push(self.heartbeat_s, self._heartbeat, 1)
        while self._heap:
            t, _, fn, arg = heapq.heappop(self._heap)
            fn(t) if arg is None else fn(t, arg)
        return requests

    def _heartbeat(self, now: float, seq: int) -> None:
        for w in self.workers.values():
            hb = w.heartbeat(seq, now)
            if self.steps is not None:
                self.steps += [(hb.worker_id, kind, s) for kind, samples in
                               (("prefill", hb.prefill_steps), ("decode", hb.decode_steps))
                               for s in samples]
            if self.registry.heartbeat(hb, now=now) and self.cost is not None:
                self.bad_samples += fit_step_samples(
                    self.cost, hb.prefill_steps, hb.decode_steps,
                    reporting_busy(self.views, hb.worker_id))[1]
            if hb.ttft_samples and self.correction is not None:
                self.correction.observe(hb.worker_id, hb.ttft_samples)
        if self.open > 0:
            if not self._heap:
                raise RuntimeError(f"{self.open} requests can never finish (t={now})")
            self.push(now + self.heartbeat_s, self._heartbeat, seq + 1)

    def _arrive(self, now: float, req: SimRequest) -> None:
        self.arrived += 1
        decision = self.route(self.views, req)
        if isinstance(decision, Rejection):
            return self.finish(req, "arrival")
        req.decode_id = decision.decode.worker_id
        dec = self.workers[req.decode_id]
        if decision.prefill is None:
            dec.accept(req, now, remote=False)
            return
        req.prefill_id = req.routed_prefill = decision.prefill.worker_id
        dec.accept(req, now, remote=True)  # it sends the Prefill to the prefill worker
