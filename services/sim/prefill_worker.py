"""The simulated prefill worker, following the live role's rules
(services/worker/prefill_role.py, services/engine/scheduler.py).

Prefill: steps of the live scheduler's token budget over the queued prompts, in
arrival order (a prompt cut by one step's budget goes first in the next), once their
blocks fit; cached
prefix from its own KV blocks, then the pool tier's blocks beyond it (fetched); at the
step's end the KV of the blocks each decode worker lacks crosses the link, one prompt
after another; their blocks then stay cached.

Costs, host factors and what reaches the conductor: as ``workers.py`` says.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from common.protocol import Heartbeat, StepSample
from services.sim.kv_blocks import KVBlocks
from services.sim.profiles import neighbour_class
from services.sim.workers import MAX_SAMPLES, STEP_TOKENS, take

if TYPE_CHECKING:
    from services.sim.request import SimContext, SimRequest


class PrefillWorker:
    def __init__(self, sim: SimContext, wid: str) -> None:
        self.sim, self.id, self.prof = sim, wid, sim.profile
        self.kv = KVBlocks(wid, self.prof.kv_blocks, sim.index)
        self.queue: deque[tuple[SimRequest, int]] = deque()  # (request, uncached estimate)
        self.queued_tokens = 0  # whole prompts, as the live snapshot counts them
        # A prompt cut by the last step's budget: (request, its tokens computed so far).
        self.partial: tuple[SimRequest, int] | None = None
        # The step in progress: its chunks (request, tokens, computed before, last),
        # compute, end.
        self.current: tuple[list[tuple[SimRequest, int, int, bool]], float, float] | None = None
        self.link_free = self.last_s = 0.0
        self.samples: deque[StepSample] = deque(maxlen=MAX_SAMPLES)
        self.dropped: set[int] = set()  # jobs whose decode worker gave up
        self.fresh: list[str] = []  # request ids taken in since the last heartbeat

    def blocks(self, req: SimRequest) -> int:
        return max(len(req.hashes), -(-req.prompt // self.prof.block_size))

    def wait_s(self, now: float) -> float:
        """True seconds of work ahead of a new arrival."""
        busy = self.current[2] - now if self.current else 0.0
        if self.partial is not None:
            req, done = self.partial
            busy += self.prof.prefill_s(req.prompt - req.cached - done, req.cached + done)
        return busy + sum(self.prof.prefill_s(n, r.prompt - n) for r, n in self.queue)

    def enqueue(self, req: SimRequest, now: float) -> None:
        n = req.prompt - min(self.kv.prefix(req.hashes) * self.prof.block_size,
                             req.prompt - 1)
        self.queue.append((req, n))
        self.queued_tokens += req.prompt
        self.fresh.append(req.request_id)
        if self.current is None:
            self._start(now)

    def drop(self, req: SimRequest) -> None:
        """The decode worker's lease ran out: a queued job goes, a running one ends
        without sending its KV."""
        for i, (r, _) in enumerate(self.queue):
            if r is req:
                del self.queue[i]
                self.queued_tokens -= r.prompt
                return
        self.dropped.add(req.rid)

    def _start(self, now: float) -> None:
        """One engine step, as the live scheduler builds it from its token budget: first
        the next chunk of a prompt the last step cut, then the queued prompts in order,
        each from its cached prefix, the last one cut where the budget ends. A prompt
        ends with the step that computes its last token."""
        if self.current is not None:
            return
        prof, pool = self.prof, self.sim.pool
        group: list[tuple[SimRequest, int, int, bool]] = []
        budget, fetch = STEP_TOKENS, 0
        if self.partial is not None:
            (req, done), self.partial = self.partial, None
            if req.rid in self.dropped:  # its decode worker gave up: no more chunks
                self.dropped.discard(req.rid)
                self.kv.release(req.rid)
            else:
                left = req.prompt - req.cached - done
                group.append((req, min(left, budget), req.cached + done, left <= budget))
                budget -= group[-1][1]
        while self.queue and budget > 0:
            req = self.queue[0][0]
            own = self.kv.admit(req.rid, req.hashes, self.blocks(req))
            if own is None:
                break  # its blocks are held by transfers in flight; a release retries
            self.queue.popleft()
            self.queued_tokens -= req.prompt
            got = max(0, pool.prefix(req.hashes) - own) if pool else 0
            req.cached = min((own + got) * prof.block_size, req.prompt - 1)
            left = req.prompt - req.cached
            group.append((req, min(left, budget), req.cached, left <= budget))
            budget -= group[-1][1]
            fetch += got
        if not group:
            return
        compute = prof.prefill_step_s([(n, c) for _, n, c, _ in group]) * \
            self.sim.jitter() * self.sim.contention(self, "prefill")
        end = now + compute + (fetch * prof.block_bytes / prof.pool_bandwidth if fetch else 0)
        self.current = (group, compute, end)
        self.sim.push(end, self._finish)

    @property
    def busy(self) -> bool:
        return self.current is not None

    def running(self) -> str:
        """What the worker runs now, as a neighbour's factor depends on it."""
        return neighbour_class(sum(n for _, n, _, _ in self.current[0])
                               if self.current else 0)

    def _finish(self, now: float) -> None:
        (group, compute, _), sim = self.current, self.sim
        self.current, self.last_s = None, compute
        self.samples.append(StepSample(seconds=compute, tokens=[n for _, n, _, _ in group],
                                       cached=[c for _, _, c, _ in group]))
        for req, n, before, last in group:
            if not last:
                self.partial = (req, before + n - req.cached)
                continue
            self.kv.commit(req.rid, req.hashes)
            if sim.pool:
                sim.pool.insert(req.hashes)  # write-back of the computed blocks
            if req.rid in self.dropped:
                self.dropped.discard(req.rid)
                self.kv.release(req.rid)
                continue
            missing = req.prompt - min(req.decode_hit * self.prof.block_size, req.prompt)
            self.link_free = max(now, self.link_free) + \
                missing * self.prof.kv_bytes_per_token / self.prof.link_bandwidth
            sim.push(self.link_free, self._sent, req)
        self._start(now)

    def _sent(self, now: float, req: SimRequest) -> None:
        self.kv.release(req.rid)
        self.sim.workers[req.decode_id].kv_arrived(now, req)
        self._start(now)

    def heartbeat(self, seq: int, now: float) -> Heartbeat:
        # As the live snapshot, taken before the step in progress: a prompt it took from
        # the queue counts whole, a cut one the tokens it had left.
        group = self.current[0] if self.current else []
        left = sum(r.prompt if c == r.cached else r.prompt - c for r, _, c, _ in group)
        if self.partial is not None:
            left += self.partial[0].prompt - self.partial[0].cached - self.partial[1]
        return Heartbeat(worker_id=self.id, role="prefill", seq=seq, running=0,
                         waiting=len(self.queue) + len(group) + (self.partial is not None),
                         queued_prefill_tokens=self.queued_tokens + left,
                         free_blocks=self.kv.free, total_blocks=self.kv.capacity,
                         step_time_ms=self.last_s * 1e3, prefill_steps=take(self.samples),
                         admitted=take(self.fresh))
