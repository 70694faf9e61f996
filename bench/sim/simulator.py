r"""An offline discrete-event simulator of a prefill/decode cluster that drives the
conductor's own policy objects over a whole trace in seconds.

    arrival --route()--> Rejection                                  (rejected "arrival")
                     \-> Decision: the decode worker is promised the request's KV blocks
      remote: prefill FIFO --prefill--> link FIFO --KV--> decode admission FIFO
      local:  decode admission FIFO --> stall the batch while prefilling on the decode worker
      admitted (free KV blocks) --> joins the batch at the next step --> output-1 steps --> done

* Prefill workers run one prompt at a time; its cached prefix is the leading blocks in
  their LRU cache (plus pool-tier blocks beyond them, fetched at ``pool_bandwidth``).
* Decode workers batch continuously; a step of B sequences holding K tokens takes
  ``profile.decode_step_s(B, K)``. Between batch changes step times form an arithmetic
  series (K grows by B a step), so the simulator jumps between changes in closed form.
* Caches publish ``stored``/``removed`` to the prefix index at once (KV events); load
  reaches the policy only in heartbeats every ``heartbeat_s`` through ``Registry``, so
  the policy sees stale counters plus its own in-flight accounting.
* TTFT = arrival to the first token at the decode worker (KV landed and admitted, or the
  local prefill done); TBT = (done - first token) / (output - 1), the request's mean.
* ``stage_reject_wait_s`` turns on per-stage rejection: at a prefill worker whose queue
  holds more than that many seconds of work, and at a decode worker whose KV is full
  when the request's KV lands (its prefill wasted).
"""

from __future__ import annotations

import heapq
import json
import math
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from bench.sim.profiles import Profile
from common.protocol import Heartbeat, WorkerInfo
from services.conductor.cache_policy import Rejection
from services.conductor.cost_model import CostModel
from services.conductor.prefix_index import PrefixIndex
from services.conductor.registry import Registry, WorkerView


@dataclass(slots=True)
class SimRequest:
    rid: int
    arrival: float
    prompt: int
    output: int  # tokens, the first one from prefill
    hashes: list[int]
    decode_id: str = ""
    prefill_id: str | None = None  # None: prefilled on its decode worker
    cached: int = 0
    first_token: float | None = None
    done: float | None = None
    rejected: str = ""  # "", "arrival", "prefill" or "decode"

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tbt(self) -> float | None:
        if self.done is None:
            return None
        return (self.done - self.first_token) / (self.output - 1) if self.output > 1 else 0.0


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


class LRUCache:
    """The blocks one location holds, least recently used first, mirrored to the index."""

    def __init__(self, location: str, capacity: int, index: PrefixIndex) -> None:
        self.location, self.capacity, self.index = location, capacity, index
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def prefix(self, hashes: list[int]) -> int:
        n = 0
        while n < len(hashes) and hashes[n] in self.blocks:
            n += 1
        return n

    def insert(self, hashes: list[int]) -> None:
        if self.capacity <= 0:
            return
        new = [h for h in hashes if h not in self.blocks]
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        evicted = [self.blocks.popitem(last=False)[0]
                   for _ in range(len(self.blocks) - self.capacity)]
        self.index.stored(self.location, new)
        self.index.removed(self.location, evicted)


class PrefillWorker:
    def __init__(self, sim: Simulator, wid: str) -> None:
        self.sim, self.id, self.prof = sim, wid, sim.profile
        self.cache = LRUCache(wid, self.prof.cache_blocks, sim.index)
        self.queue: deque[tuple[SimRequest, int]] = deque()  # (request, uncached estimate)
        self.queued_tokens = 0
        self.current: tuple[SimRequest, int, float, float] | None = None  # n, compute, end
        self.link_free = self.last_s = 0.0

    def wait_s(self, now: float) -> float:
        """True seconds of work ahead of a new arrival."""
        busy = self.current[3] - now if self.current else 0.0
        return busy + sum(self.prof.prefill_s(n, r.prompt - n) for r, n in self.queue)

    def enqueue(self, req: SimRequest, now: float) -> None:
        n = req.prompt - min(self.cache.prefix(req.hashes) * self.prof.block_size,
                             req.prompt - 1)
        self.queue.append((req, n))
        self.queued_tokens += n
        if self.current is None:
            self._start(now)

    def _start(self, now: float) -> None:
        req, est = self.queue.popleft()
        self.queued_tokens -= est
        prof, pool = self.prof, self.sim.pool
        own = self.cache.prefix(req.hashes)
        fetch = max(0, pool.prefix(req.hashes) - own) if pool else 0
        req.cached = min((own + fetch) * prof.block_size, req.prompt - 1)
        n = req.prompt - req.cached
        compute = prof.prefill_s(n, req.cached)
        end = now + compute + (fetch * prof.block_bytes / prof.pool_bandwidth if fetch else 0)
        self.current = (req, n, compute, end)
        self.sim.push(end, self._finish)

    def _finish(self, now: float) -> None:
        (req, n, compute, _), sim = self.current, self.sim
        self.current, self.last_s = None, compute
        self.cache.insert(req.hashes)
        if sim.pool:
            sim.pool.insert(req.hashes)
        if sim.cost:
            sim.cost.observe_prefill(n, req.cached, compute)
        self.link_free = max(now, self.link_free) + \
            req.prompt * self.prof.kv_bytes_per_token / self.prof.link_bandwidth
        sim.push(self.link_free, sim.workers[req.decode_id].kv_arrived, req)
        if self.queue:
            self._start(now)

    def heartbeat(self, seq: int, now: float) -> Heartbeat:
        left = 0
        if self.current and self.current[2] > 0:
            _, n, compute, end = self.current
            left = int(n * min(1.0, (end - now) / compute))
        kv = self.prof.kv_blocks
        return Heartbeat(worker_id=self.id, role="prefill", seq=seq, running=0,
                         waiting=len(self.queue) + (self.current is not None),
                         queued_prefill_tokens=self.queued_tokens + left, free_blocks=kv,
                         total_blocks=kv, step_time_ms=self.last_s * 1e3)


class DecodeWorker:
    def __init__(self, sim: Simulator, wid: str) -> None:
        self.sim, self.id, self.prof = sim, wid, sim.profile
        self.cache = LRUCache(wid, self.prof.cache_blocks, sim.index)
        self.finish: list[tuple[int, int, SimRequest]] = []  # (last step, rid, request)
        self.joined: dict[int, int] = {}  # rid -> step count when it joined
        self.B = self.K = self.steps = 0  # batch, context tokens, steps run
        self.t = self.last_step = 0.0  # t: time of the last step boundary
        self.used = self.promised = self.incoming = 0  # blocks, blocks, requests
        self.admit_q: deque[tuple[SimRequest, bool]] = deque()  # (request, prefill here)
        self.local: deque[SimRequest] = deque()
        self.joiners: list[SimRequest] = []
        self.stalled, self.version = False, 0

    def need(self, req: SimRequest) -> int:
        return -(-(req.prompt + req.output) // self.prof.block_size)

    def promise(self, req: SimRequest, now: float, local: bool) -> None:
        self.promised += self.need(req)
        self.incoming += 1
        if local:
            self.admit_q.append((req, True))
            self._pump(now)

    def kv_arrived(self, now: float, req: SimRequest) -> None:
        if self.sim.stage_reject_wait_s is not None and \
                self.used + self.need(req) > self.prof.kv_blocks:
            self.promised -= self.need(req)
            self.incoming -= 1
            self.sim.finish(req, "decode")
            return
        self.admit_q.append((req, False))
        self._pump(now)

    def _pump(self, now: float) -> None:
        while self.admit_q and self.used + self.need(self.admit_q[0][0]) <= self.prof.kv_blocks:
            req, local = self.admit_q.popleft()
            self.promised -= self.need(req)
            self.used += self.need(req)
            self.incoming -= 1
            if local:
                self.local.append(req)
            else:
                req.first_token = now
                self.joiners.append(req)
        self._schedule(now)

    def _time_at(self, m: int) -> float:
        """Time of the boundary ``m`` steps after the last one, the batch unchanged."""
        half_slope = self.prof.cost.decode_per_ctx_token_s * self.B / 2
        return self.t + m * self.prof.decode_step_s(self.B, self.K) + half_slope * m * (m - 1)

    def _schedule(self, now: float) -> None:
        """Book the next boundary where the batch changes: the first to end a request,
        or, with requests to add, the first at or after ``now``."""
        if self.stalled:
            return
        self.version += 1
        if self.B == 0:
            self.t = max(self.t, now)
            if self.joiners or self.local:
                self.sim.push(self.t, self._boundary, (self.version, 0))
            return
        m = self.finish[0][0] - self.steps
        if self.joiners or self.local:
            h = self.prof.cost.decode_per_ctx_token_s * self.B / 2
            s0, dt = self.prof.decode_step_s(self.B, self.K), now - self.t
            root = dt / s0 if h == 0 else \
                (-(s0 - h) + math.sqrt((s0 - h) ** 2 + 4 * h * dt)) / (2 * h)
            k = max(1, math.ceil(root))
            k = k - 1 if k > 1 and self._time_at(k - 1) >= now else k
            m = min(m, k + 1 if self._time_at(k) < now else k)
        self.sim.push(self._time_at(m), self._boundary, (self.version, m))

    def _boundary(self, now: float, arg: tuple[int, int]) -> None:
        version, m = arg
        if version != self.version:
            return
        if m:
            self.last_step = (self._time_at(m) - self.t) / m
            if self.sim.cost:
                self.sim.cost.observe_decode(self.B, self.K + self.B * (m - 1) // 2,
                                             self.last_step)
            self.K += m * self.B
            self.steps += m
        self.t = now
        while self.finish and self.finish[0][0] <= self.steps:
            self._retire(heapq.heappop(self.finish)[2], now, joined=True)
        if self.local:
            return self._start_local(now)
        for req in self.joiners:
            if req.output <= 1:
                self._retire(req, now, joined=False)
                continue
            self.joined[req.rid] = self.steps
            heapq.heappush(self.finish, (self.steps + req.output - 1, req.rid, req))
            self.B += 1
            self.K += req.prompt
        self.joiners.clear()
        self._pump(now)

    def _retire(self, req: SimRequest, now: float, joined: bool) -> None:
        if joined:
            self.B -= 1
            self.K -= req.prompt + self.steps - self.joined.pop(req.rid)
        self.used -= self.need(req)
        self.cache.insert(req.hashes)  # freed blocks stay cached until evicted
        self.sim.finish(req, "", now)

    def _start_local(self, now: float) -> None:
        req = self.local.popleft()
        req.cached = min(self.cache.prefix(req.hashes) * self.prof.block_size, req.prompt - 1)
        n = req.prompt - req.cached
        compute = self.prof.prefill_s(n, req.cached)
        if self.sim.cost:
            self.sim.cost.observe_prefill(n, req.cached, compute)
        self.stalled = True
        self.version += 1
        self.sim.push(now + compute, self._end_local, req)

    def _end_local(self, now: float, req: SimRequest) -> None:
        self.stalled, self.t, req.first_token = False, now, now  # the batch resumes now
        self.cache.insert(req.hashes)
        self.joiners.append(req)
        self._boundary(now, (self.version, 0))

    def heartbeat(self, seq: int, now: float) -> Heartbeat:
        kv = self.prof.kv_blocks
        local = sum(r.prompt for r in self.local) + sum(r.prompt for r, x in self.admit_q if x)
        return Heartbeat(worker_id=self.id, role="decode", seq=seq, running=self.B,
                         waiting=self.incoming + len(self.joiners) + len(self.local),
                         queued_prefill_tokens=local, total_blocks=kv,
                         free_blocks=max(0, kv - self.used - self.promised),
                         step_time_ms=self.last_step * 1e3)


Router = Callable[[list[WorkerView], SimRequest], object]  # -> Decision | Rejection


class Simulator:
    """One run: ``Simulator(...).run(requests)`` fills in every request's outcome."""

    def __init__(self, profile: Profile, route: Router, *, prefill: int, decode: int,
                 index: PrefixIndex | None = None, cost: CostModel | None = None,
                 heartbeat_s: float = 1.0, pool_blocks: int = 0,
                 stage_reject_wait_s: float | None = None) -> None:
        if decode <= 0 or prefill < 0 or heartbeat_s <= 0:
            raise ValueError("need decode >= 1, prefill >= 0 workers and heartbeat_s > 0")
        if pool_blocks and profile.pool_bandwidth <= 0:
            raise ValueError("a pool tier needs profile.pool_bandwidth > 0")
        self.profile, self.route, self.cost = profile, route, cost
        self.index = PrefixIndex() if index is None else index
        self.heartbeat_s, self.stage_reject_wait_s = heartbeat_s, stage_reject_wait_s
        self.pool = LRUCache("pool:dram", pool_blocks, self.index) if pool_blocks else None
        self.registry = Registry(heartbeat_s)
        self.workers: dict[str, PrefillWorker | DecodeWorker] = {}
        for role, cls, count in (("prefill", PrefillWorker, prefill),
                                 ("decode", DecodeWorker, decode)):
            for i in range(count):
                wid = f"{role}-{i}"
                self.workers[wid] = cls(self, wid)
                self.registry.workers[wid] = WorkerView(WorkerInfo(
                    worker_id=wid, role=role, model="sim", control_addr="", kv_addr="",
                    host_id=wid, block_size=profile.block_size, num_blocks=profile.kv_blocks,
                    fingerprint=profile.name), last_seen=0.0, free_blocks=profile.kv_blocks)
        self.views = list(self.registry.workers.values())
        self._heap: list = []
        self._seq = self.open = 0

    def push(self, t: float, fn: Callable, arg: object = None) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn, arg))

    def finish(self, req: SimRequest, rejected: str, now: float | None = None) -> None:
        req.rejected, req.done = rejected, now
        self.open -= 1

    def run(self, requests: list[SimRequest]) -> list[SimRequest]:
        cap, bs = self.profile.kv_blocks, self.profile.block_size
        for req in requests:
            if -(-(req.prompt + req.output) // bs) > cap:
                raise ValueError(f"request {req.rid} needs more than the {cap} KV blocks "
                                 "of a decode worker")
            self.push(req.arrival, self._arrive, req)
        self.open = len(requests)
        self.push(self.heartbeat_s, self._heartbeat, 1)
        while self._heap:
            t, _, fn, arg = heapq.heappop(self._heap)
            fn(t) if arg is None else fn(t, arg)
        return requests

    def _heartbeat(self, now: float, seq: int) -> None:
        for w in self.workers.values():
            self.registry.heartbeat(w.heartbeat(seq, now), now=now)
        if self.open > 0:
            if not self._heap:
                raise RuntimeError(f"{self.open} requests can never finish (t={now})")
            self.push(now + self.heartbeat_s, self._heartbeat, seq + 1)

    def _arrive(self, now: float, req: SimRequest) -> None:
        decision = self.route(self.views, req)
        if isinstance(decision, Rejection):
            return self.finish(req, "arrival")
        req.decode_id = decision.decode.worker_id
        dec = self.workers[req.decode_id]
        if decision.prefill is None:
            return dec.promise(req, now, local=True)
        req.prefill_id = decision.prefill.worker_id
        pre = self.workers[req.prefill_id]
        if self.stage_reject_wait_s is not None and pre.wait_s(now) > self.stage_reject_wait_s:
            return self.finish(req, "prefill")
        dec.promise(req, now, local=False)
        pre.enqueue(req, now)
