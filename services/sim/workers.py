"""Simulated prefill and decode workers, following the live roles' rules
(services/worker/prefill_role.py, decode_role.py; services/engine/remote_prefill.py).

Decode, for a request routed to a prefill worker: between engine steps (at once when
idle, else at the end of the step or prefill chunk in progress) reserve its blocks
(reusing its own cached prefix), send the Prefill and wait for the KV under a lease of
``kv_lease_s``; without free blocks, prefill it here (per-stage rejection on: reject
it). KV landed in time joins the batch at the next step boundary; a lease run out
frees the blocks, drops the prefill worker's job, and queues the prompt here. A local
prompt waits in the engine's queue until its blocks are free, then prefills in one step
with the running batch's decode, as the live scheduler mixes them: the prompts that fit
``STEP_TOKENS`` together, the step their prefill plus the batch's decode step.

Prefill: ``prefill_worker.py``.

On one shared host (``Simulator(shared_host=True)``) a prefill costs the profile's time
times its contention factor for the processes busy when it starts (the simulator's
``contention``; the prefill factors where measured apart), a decode worker's steps the
decode factor as sampled at each batch change (a run of steps keeps it), plus the
serving path's overhead per sequence; a mixed step takes each part's when it starts.

Timings reach the conductor only in heartbeats, as step samples of work already done,
and a decode worker's first-token times (``TtftSample``: from the request's arrival
there to its KV landing, or to the end of its local prefill) for the TTFT correction.
Each heartbeat acknowledges (``Heartbeat.admitted``) every request the worker took in
since the last one, finished ones included, as the live engine's load snapshot
(services/worker/engine_loop.py), taken between steps, has seen it; by it a prompt
counts as waiting, with all its tokens (cached prefix included), until the step that
prefills it has ended.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from typing import TYPE_CHECKING

from common.protocol import Heartbeat, StepSample
from common.records import TtftSample
from services.sim.kv_blocks import KVBlocks
from services.sim.profiles import neighbour_class

if TYPE_CHECKING:
    from services.sim.request import SimContext, SimRequest

MAX_SAMPLES = 32  # per heartbeat and kind, as a live worker sends
# Prompt tokens one engine step takes at most (services/engine/scheduler.py's default
# max_num_batched_tokens); a longer prompt goes alone (its chunks' ends: ``cuts``).
STEP_TOKENS = 2048


def take(samples: deque) -> list:
    out = list(samples)
    samples.clear()
    return out


class DecodeWorker:
    def __init__(self, sim: SimContext, wid: str) -> None:
        self.sim, self.id, self.prof = sim, wid, sim.profile
        self.kv = KVBlocks(wid, self.prof.kv_blocks, sim.index)
        self.finish: list[tuple[int, int, SimRequest]] = []  # (last step, rid, request)
        self.joined: dict[int, int] = {}  # rid -> step count when it joined
        self.B = self.K = self.steps = 0  # batch, context tokens, steps run
        self.t = self.last_step = 0.0  # t: time of the last step boundary
        self.factor = 1.0  # noise on the step times until the batch changes
        self.awaiting: dict[int, SimRequest] = {}  # reserved, KV not landed
        self.queued: deque[SimRequest] = deque()  # local prompts waiting for blocks
        self.local: deque[SimRequest] = deque()  # local prompts holding blocks
        self.prefilling: list[SimRequest] = []  # the local prompts in the step running
        self.joiners: list[SimRequest] = []
        self.arriving: list[SimRequest] = []  # remote, to reserve at the step's end
        self.cuts: list[float] = []  # chunk ends of the local prefill step running
        self.stalled, self.version = False, 0
        self.prefill_samples: deque[StepSample] = deque(maxlen=MAX_SAMPLES)
        self.decode_samples: deque[StepSample] = deque(maxlen=MAX_SAMPLES)
        self.fallbacks = 0
        self.ttft_samples: deque[TtftSample] = deque(maxlen=64)  # as live, per heartbeat
        self.fresh: list[str] = []  # request ids taken in since the last heartbeat
        self.leased_out: set[int] = set()  # routed remote, prefilled here after the lease

    @property
    def busy(self) -> bool:
        return self.B > 0 or self.stalled

    def running(self) -> str:
        """What the worker runs now, as a neighbour's factor depends on it."""
        return neighbour_class(sum(r.prompt - r.cached for r in self.prefilling)
                               if self.stalled else 0)

    def need(self, req: SimRequest) -> int:
        return max(len(req.hashes), -(-(req.prompt + req.output) // self.prof.block_size))

    def accept(self, req: SimRequest, now: float, *, remote: bool) -> None:
        """Take ``req`` in: queued to prefill here, or (``remote``) its blocks reserved
        and its Prefill sent under the lease by a command on the engine thread, between
        steps: during a step or a long prompt's chunk it waits for its end."""
        if not remote:
            self.fresh.append(req.request_id)
            self.queued.append(req)
            return self._pump(now)
        if not self.busy:
            self._reserve(req, now)
            return self._pump(now)
        self.arriving.append(req)
        cut = next((t for t in self.cuts if t >= now), None) if self.stalled else None
        self.sim.push(cut, self._between_chunks) if cut is not None else self._schedule(now)

    def _between_chunks(self, now: float) -> None:  # a long prompt's chunk ended
        if self.stalled:
            for req in self.arriving:
                self._reserve(req, now)
            self.arriving.clear()

    def _reserve(self, req: SimRequest, now: float) -> None:
        """Reserve its blocks and send its Prefill, else queue it here (or reject)."""
        stage = self.sim.stage_reject(req, now)  # as the Prefill reaches its worker
        hit = None if stage else self.kv.admit(req.rid, req.hashes, self.need(req))
        if stage or (hit is None and self.sim.stage_reject_wait_s is not None):
            return self.sim.finish(req, stage or "decode", None)
        self.fresh.append(req.request_id)
        if hit is None:
            req.prefill_id, req.fell_back = None, True
            return self.queued.append(req)
        req.decode_hit = hit
        self.awaiting[req.rid] = req
        self.sim.push(now + self.sim.kv_lease_s, self._lease_out, req)
        self.sim.workers[req.prefill_id].enqueue(req, now)

    def kv_arrived(self, now: float, req: SimRequest) -> None:
        if self.awaiting.pop(req.rid, None) is None:
            return  # its lease ran out: it is prefilled here
        self.kv.commit(req.rid, req.hashes)
        req.first_token = now
        self.ttft_samples.append(TtftSample(request_id=req.request_id,
                                            seconds=now - req.arrival, remote=True))
        self.joiners.append(req)
        self._schedule(now)

    def _lease_out(self, now: float, req: SimRequest) -> None:
        if self.awaiting.pop(req.rid, None) is None:
            return
        self.kv.release(req.rid)
        self.sim.workers[req.prefill_id].drop(req)
        req.prefill_id, req.fell_back = None, True
        self.leased_out.add(req.rid)
        self.fallbacks += 1
        self.queued.append(req)
        self._pump(now)

    def _pump(self, now: float) -> None:
        """Admit queued local prompts, in order, while their blocks fit."""
        pool, bs = self.sim.pool, self.prof.block_size
        while self.queued:
            req = self.queued[0]
            own = self.kv.admit(req.rid, req.hashes, self.need(req))
            if own is None:
                break
            self.queued.popleft()
            req.fetch = max(0, pool.prefix(req.hashes) - own) if pool else 0
            req.cached = min((own + req.fetch) * bs, req.prompt - 1)
            self.local.append(req)
        self._schedule(now)

    def step_s(self) -> float:
        """Seconds of a step at the last batch change (the context grows slowly)."""
        return self._first_step()

    def _first_step(self) -> float:
        """The next step's seconds: the engine's, times noise and contention, plus the
        serving path's per-token overhead on a shared host."""
        return self.factor * self.prof.decode_step_s(self.B, self.K) + \
            self.B * self.sim.token_overhead_s

    def _half_slope(self) -> float:
        """Half what each step adds to the next (its context grows by B tokens)."""
        return self.factor * self.prof.cost.decode_per_ctx_token_s * self.B / 2 * \
            self.prof.shape(self.B)

    def _time_at(self, m: int) -> float:
        """Time of the boundary ``m`` steps after the last one, the batch unchanged."""
        half_slope = self._half_slope()
        return self.t + m * self._first_step() + half_slope * m * (m - 1)

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
        if self.joiners or self.local or self.arriving:
            h = self._half_slope()
            s0, dt = self._first_step(), now - self.t
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
            self.decode_samples.append(StepSample(seconds=self.last_step, batch=self.B,
                                           context=self.K + self.B * (m - 1) // 2))
            self.K += m * self.B
            self.steps += m
        self.t = now
        while self.finish and self.finish[0][0] <= self.steps:
            self._retire(heapq.heappop(self.finish)[2], now, joined=True)
        for req in self.joiners:
            if req.output <= 1:
                self._retire(req, now, joined=False)
                continue
            self.joined[req.rid] = self.steps
            heapq.heappush(self.finish, (self.steps + req.output - 1, req.rid, req))
            self.B += 1
            self.K += req.prompt
        self.joiners.clear()
        for req in self.arriving:  # the commands queued during the step
            self._reserve(req, now)
        self.arriving.clear()
        if self.local:
            return self._start_local(now)
        self.factor = self.sim.jitter() * self.sim.contention(self, "decode")
        self._pump(now)

    def _retire(self, req: SimRequest, now: float, joined: bool) -> None:
        if joined:
            self.B -= 1
            self.K -= req.prompt + self.steps - self.joined.pop(req.rid)
        self.kv.release(req.rid)  # its prompt blocks stay cached until evicted
        self.sim.finish(req, "", now)

    def _start_local(self, now: float) -> None:
        """One engine step, as the live scheduler builds it: the running batch's decode
        tokens and the local prompts that fit in the step's token budget (at least
        one), in one forward: the profile's prefill step of those prompts plus the
        decode step of the batch, as the sim executor (services/engine/sim.py) counts
        a mixed step. The batch gains one token at its end; no decode-only step runs
        while local prompts wait."""
        group, tokens = [], 0
        while self.local and (not group or tokens + self.local[0].prompt
                              - self.local[0].cached <= STEP_TOKENS):
            req = self.local.popleft()
            group.append(req)
            tokens += req.prompt - req.cached
        self.prefilling = group
        chunks = [(r.prompt - r.cached, r.cached) for r in group]
        prefill = self.prof.prefill_step_s(chunks) * self.sim.jitter() * \
            self.sim.contention(self, "prefill")
        decode = self.prof.decode_step_s(self.B, self.K) * \
            self.sim.contention(self, "decode") + \
            self.B * self.sim.token_overhead_s
        fetch_s = sum(r.fetch for r in group) * self.prof.block_bytes / \
            self.prof.pool_bandwidth if any(r.fetch for r in group) else 0.0
        self.stalled, start = True, now + fetch_s
        self.cuts = [start + prefill * f for f in self.prof.chunk_ends(
            *chunks[0], STEP_TOKENS)] if tokens > STEP_TOKENS else []
        self.version += 1
        self.sim.push(start + prefill + decode, self._end_local, (chunks, prefill))

    def _end_local(self, now: float, arg: tuple[list, float]) -> None:
        chunks, prefill = arg
        self.prefill_samples.append(StepSample(seconds=prefill, tokens=[n for n, _ in chunks],
                                               cached=[c for _, c in chunks]))
        self.stalled, self.t = False, now  # the batch resumes now
        if self.B:  # the step's decode token for every running sequence
            self.K += self.B
            self.steps += 1
        for req in self.prefilling:
            req.first_token = now
            # Live, a request whose Prefill was forwarded stays "remote" when it falls back.
            self.ttft_samples.append(TtftSample(request_id=req.request_id,
                                                seconds=now - req.arrival,
                                                remote=req.rid in self.leased_out))
            self.leased_out.discard(req.rid)
            self.kv.commit(req.rid, req.hashes)
            if self.sim.pool:  # a decode or unified worker writes back what it computed
                self.sim.pool.insert(req.hashes)
            self.joiners.append(req)
        self.prefilling = []
        self._boundary(now, (self.version, 0))

    def heartbeat(self, seq: int, now: float) -> Heartbeat:
        # Local prompts count whole until their prefill step ends, as live.
        prompts = [*self.queued, *self.local, *self.prefilling]
        local = sum(r.prompt for r in prompts)
        return Heartbeat(worker_id=self.id, role="decode", seq=seq,
                         running=self.B + len(self.joiners),
                         waiting=len(prompts),
                         waiting_for_kv=len(self.awaiting), queued_prefill_tokens=local,
                         free_blocks=self.kv.free, total_blocks=self.kv.capacity,
                         step_time_ms=self.last_step * 1e3,
                         prefill_steps=take(self.prefill_samples),
                         decode_steps=take(self.decode_samples),
                         ttft_samples=take(self.ttft_samples),
                         admitted=take(self.fresh))
