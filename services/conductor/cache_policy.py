"""The cache- and load-aware policy: predicted TTFT and TBT, conditional disaggregation,
and SLO admission. A pure object: worker views, the prefix index and the cost model in,
a decision out; it touches nothing but the views' in-flight counters and its own ledger.

For one request (``P`` prompt tokens, chain of block hashes, ``O`` output tokens)::

    decode  = argmin over decode workers with free KV blocks >= ceil((P + O) / block)
              of  TBT = decode_step(batch + 1, context + P + O/2)
                      + (its queued local prefills, which stall the batch) / (O - 1)
    for each prefill worker p of the decode worker's fingerprint:
        cached(p) = its own prefix + pool blocks beyond it      (from the index; the pool's
                    prefix counts a block held by any of its instances)
        TTFT(p)   = queue(p)                                     queued + in-flight tokens
                  + prefill(P - cached(p), cached(p))
                  + pool fetch(pool blocks beyond its own)
                  + KV transfer(P * kv_bytes_per_token over the link)
                  + the decode worker's queue of local prefills and the decode step
                    in progress (it forwards the Prefill only between its engine
                    steps, after those)
    local  = TTFT on the decode worker itself: its own prefix, its local prefill queue,
             the decode step in progress; no transfer. Allowed when nothing runs there, or
             when its local prefill queue and this prefill stall the running batch for at
             most min(max_decode_stall_s, (slo_tbt_s - its step time) * (O_mean - 1)),
             O_mean the mean planned output of the requests accepted so far (2 before
             any): the stall then keeps a running request of the workload's mean output
             within its TBT SLO (a shorter one may miss it).
    choose the lower of best remote and local: the crossover moves with measured costs;
    but a remote prefill predicted to outlast the workers' KV lease (``kv_lease_s``)
    would be prefilled on the decode worker anyway, a lease later: local, on the decode
    worker with room where its TTFT times (1 + the requests its stall holds up) is least.
    Then a local prefill on another decode worker with room that holds more of the
    prompt's prefix (the one that served the previous turn) replaces the choice when it
    is predicted sooner and its stall keeps within that worker's budget.

The cost model predicts a worker alone on its host; every compute time above (not the
link transfer) is multiplied by the profile's contention factor for the workers busy on
the worker's host, it counted (``contention.py``; 1.0 without factors). Every TTFT
above is then multiplied by the learned factor of its path and worker
(``ttft_correction.py``: "remote" and the prefill worker, "local" and the decode
worker; 1.0 until enough first tokens were observed), before the choice.

Admission (prediction-based early rejection, on unless ``admission=False``):
``Rejection`` when no decode worker has room for the request's KV, when the predicted
TBT exceeds ``slo_tbt_s`` or the best corrected TTFT times the correction's ``margin``
exceeds ``slo_ttft_s``. Nothing is accounted for a rejection. With ``admission=False``
the SLOs still shape routing. A ``Decision`` carries the uncorrected TTFT it predicted,
for the correction to learn from once the first token is observed.

Load of a decode worker: its running batch, its local prefill queue (``waiting``), the
remote prefills whose KV it awaits (``waiting_for_kv``: they join the batch when the
KV lands) and the decisions since its heartbeat; its room: free blocks less those its
held requests will still take for their output (``reserved_blocks``).

In-flight accounting: an accepted decision adds one request and its *uncached* tokens
to the prefill location's ``pending_*`` counters (on a prefill worker kept through its
next heartbeat, which may not show the request yet, or longer while the decode worker's own
prompts hold it back: ``Registry.heartbeat``) and, until that
heartbeat, its KV blocks to the decode worker's ledger. The local queue is the decode
worker's waiting prompts plus those routed there since, drained in turn. The queue term
grows with every request routed to a worker, so a burst sharing one cached prefix piles
onto the worker holding it only while that stays cheaper than a full prefill elsewhere.
The ledger is keyed on the view's ``last_seen``: a heartbeat also voids it. A decision
with a request id (the conductor's) on a worker whose heartbeats acknowledge requests
(``Heartbeat.admitted``) is kept per request instead (``WorkerView.route``): until a
heartbeat of that worker lists it, so one sent while the request was still on its way
does not hide it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from services.conductor.contention import busy_by_host, busy_on_host, host_factor
from services.conductor.cost_model import CostModel, pool_fetch_time, transfer_time
from services.conductor.prefix_index import PrefixIndex
from services.conductor.registry import Inflight, WorkerView
from services.conductor.routing_policy import (
    Decision,
    PolicyRequest,
    Rejection,
    RoutingPolicy,
    candidates,
)
from services.conductor.ttft_correction import TtftCorrection

POOL_PREFIX = "pool:"
# A decision for a prefill worker whose decode worker has prompts of its own queued stays
# pending through this many more of the prefill worker's heartbeats: one local prefill
# step (up to max_num_batched_tokens) may outlast an interval.
HOLD_BEATS = 2


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    kv_bytes_per_token: int
    link_bandwidth: float  # bytes/s, prefill worker -> decode worker
    pool_bandwidth: float = 0.0  # bytes/s, pool tier -> worker; 0 ignores the pool
    max_decode_stall_s: float = 0.5
    # How long a decode worker waits for a remote prefill's KV before prefilling the
    # prompt itself (the workers' ``kv_lease_s``); math.inf: never.
    kv_lease_s: float = 10.0
    # The profile's step factor with k workers busy on one host (``contention[k-1]``;
    # (): not measured, 1.0): workers sharing a host's cores slow each other's steps.
    contention: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.kv_bytes_per_token <= 0:
            raise ValueError(f"kv_bytes_per_token must be > 0, got {self.kv_bytes_per_token}")
        if self.link_bandwidth <= 0:
            raise ValueError(f"link_bandwidth must be > 0, got {self.link_bandwidth}")
        if self.pool_bandwidth < 0 or self.max_decode_stall_s < 0:
            raise ValueError("pool_bandwidth and max_decode_stall_s must be >= 0")
        if not self.kv_lease_s > 0:
            raise ValueError(f"kv_lease_s must be > 0, got {self.kv_lease_s}")
        if not all(1.0 <= f < math.inf for f in self.contention):
            raise ValueError(f"contention factors must be >= 1, got {self.contention}")


class Estimate(NamedTuple):
    ttft_s: float
    worker: WorkerView
    hit_blocks: int  # own prefix plus pool blocks fetched
    uncached: int
    queue_s: float
    step_s: float  # the decode step in progress there (local only)
    raw_s: float  # ttft_s before the learned correction
    factor: float  # the correction: ttft_s = raw_s * factor


class _Ledger:
    __slots__ = ("stamp", "kv_blocks", "kv_tokens", "local")

    def __init__(self, stamp: float) -> None:
        self.stamp, self.kv_blocks, self.kv_tokens, self.local = stamp, 0, 0, 0


class CacheAwarePolicy(RoutingPolicy):
    name = "cache_aware"

    def __init__(self, index: PrefixIndex, cost: CostModel, config: PolicyConfig,
                 correction: TtftCorrection | None = None) -> None:
        self.index = index
        self.cost = cost
        self.config = config
        self.correction = TtftCorrection() if correction is None else correction
        self._ledgers: dict[str, _Ledger] = {}
        self._busy: dict[str, set[str]] = {}  # per host, its busy workers (``decide``)
        self._outputs = [0, 0]  # accepted requests with a planned output: count, tokens

    def _ledger(self, w: WorkerView) -> _Ledger:
        led = self._ledgers.get(w.worker_id)
        if led is None or led.stamp != w.last_seen:
            led = self._ledgers[w.worker_id] = _Ledger(w.last_seen)
        return led

    def _unacked(self, w: WorkerView) -> tuple[int, int, int]:
        """What was routed to decode worker ``w`` that its heartbeats do not show yet:
        local prefills, KV blocks, KV tokens (the ledger's anonymous decisions since the
        last heartbeat, and the in-flight ones by request id until acknowledged)."""
        led = self._ledger(w)
        if not w.inflight:
            return led.local, led.kv_blocks, led.kv_tokens
        return (led.local + w.inflight_sum("local"), led.kv_blocks + w.inflight_sum("kv_blocks"),
                led.kv_tokens + w.inflight_sum("kv_tokens"))

    def decide(self, workers: list[WorkerView], request: PolicyRequest) -> Decision | Rejection:
        """Route one request and account it; see the module docstring. Raises
        ``NoWorkers`` when no live decode or unified worker is left, ``ValueError`` on
        bad sizes."""
        r = request
        prompt_tokens, block_hashes, block_size = r.prompt_tokens, r.block_hashes, r.block_size
        slo_ttft_s, slo_tbt_s = r.slo_ttft_s, r.slo_tbt_s
        output_tokens, admission = r.output_tokens, r.admission
        if prompt_tokens <= 0 or block_size <= 0 or output_tokens < 0:
            raise ValueError(f"bad request sizes: prompt {prompt_tokens}, block {block_size}, "
                             f"output {output_tokens}")
        usable, decoders = candidates(workers, request)
        self._busy = busy_by_host(workers)
        decode, tbt, fits, roomy = self._pick_decode(decoders, prompt_tokens, output_tokens)
        admit = admission and (math.isfinite(slo_ttft_s) or math.isfinite(slo_tbt_s))
        if admit and not fits:
            return Rejection(f"no decode worker has room for {prompt_tokens + output_tokens} "
                             "tokens of KV", 1.0)
        if admission and tbt > slo_tbt_s:
            return Rejection(f"predicted TBT {tbt * 1e3:.1f}ms > SLO {slo_tbt_s * 1e3:.1f}ms "
                             f"on {decode.worker_id}", 1.0)
        hits = self.index.match(block_hashes)
        # The pool's instances together: placement spreads one chain over all of them.
        pool = (self.index.match_group(block_hashes, POOL_PREFIX)
                if self.config.pool_bandwidth > 0 else 0)
        chain = (prompt_tokens, block_size, hits, pool)
        local = self._estimate(decode, chain, remote=False)
        prefillers = [w for w in usable if w.role == "prefill"
                      and w.fingerprint == decode.fingerprint] if decode.role == "decode" else []
        remote = min((self._estimate(p, chain, remote=True) for p in prefillers),
                      key=lambda e: (e.ttft_s, -e.hit_blocks, e.worker.worker_id), default=None)
        ahead = local.queue_s - local.step_s
        # The lease runs from the decode worker's forwarding of the Prefill to the KV's
        # landing: a remote prefill predicted to outlast it is prefilled here all the
        # same, a lease later, its prefill worker's time wasted.
        lapses = remote is not None and remote.ttft_s > self.config.kv_lease_s
        # The decode worker takes a remote request (its KV blocks, then the Prefill it
        # sends) only between engine steps: the decode step in progress and the prompts
        # it prefills itself, queued before this one, go first.
        wait = max(0.0, ahead) + (local.step_s if decode.running else 0.0)
        if remote is not None and wait > 0:
            remote = remote._replace(ttft_s=remote.ttft_s + wait * remote.factor,
                                     raw_s=remote.raw_s + wait)
        stall = local.ttft_s - local.step_s  # its local queue runs first, also stalling
        busy = decode.load
        budget = self._stall_budget(slo_tbt_s, local.step_s)
        if remote is None:
            best, why = local, ("colocated" if decode.role == "unified" else "no prefill worker")
        elif lapses:
            # It stalls its decode worker's batch wherever it runs: choose the worker
            # where this prompt's wait plus the stall of every request there, in
            # request-seconds, is least.
            local, decode, tbt = min(
                ((self._estimate(d, chain, remote=False), d, t) for d, t in roomy
                 if d.fingerprint == decode.fingerprint and not (admission and t > slo_tbt_s)),
                key=lambda e: (e[0].ttft_s * (1 + e[1].load), e[1].worker_id),
                default=(local, decode, tbt))
            best, why = local, (f"remote {remote.ttft_s:.3f}s would outlast the "
                                f"{self.config.kv_lease_s:g}s KV lease")
        elif busy and stall > budget:
            best, why = remote, f"local prefill would stall {busy} decodes {stall:.3f}s"
        elif local.ttft_s <= remote.ttft_s:
            best, why = local, f"local {local.ttft_s:.3f}s <= remote {remote.ttft_s:.3f}s"
        else:
            best, why = remote, f"remote {remote.ttft_s:.3f}s < local {local.ttft_s:.3f}s"
        if remote is not None and not lapses:
            best, decode, tbt, why = self._holder(best, decode, tbt, why, roomy, chain,
                                                  slo_tbt_s, admission)
        margin = self.correction.config.margin
        if admission and best.ttft_s * margin > slo_ttft_s:
            return Rejection(f"predicted TTFT {best.ttft_s:.3f}s{_times(best.factor, margin)} "
                             f"> SLO {slo_ttft_s:.3f}s",
                             max(1.0, best.ttft_s * margin - slo_ttft_s))
        self._account(best, decode, prompt_tokens + output_tokens, max(0.0, ahead), r)
        if output_tokens:
            self._outputs = [self._outputs[0] + 1, self._outputs[1] + output_tokens]
        nblocks = len(block_hashes)
        reason = (f"{why}; prefill on {best.worker.worker_id} hit {best.hit_blocks}/{nblocks} "
                  f"blocks, queue {best.queue_s:.3f}s, ttft {best.ttft_s:.3f}s"
                  f"{_times(best.factor, 1.0)}; decode tbt {tbt * 1e3:.1f}ms")
        return Decision(decode, None if best.worker is decode else best.worker, reason,
                        best.raw_s)

    def _holder(self, best: Estimate, decode: WorkerView, tbt: float, why: str,
                roomy: list, chain: tuple, slo_tbt_s: float, admission: bool) -> tuple:
        """The decision, or a local prefill on another decode worker with room that holds
        more of the prompt's prefix than ``decode`` when that is predicted sooner and
        stalls its batch within the budget: a follow-up turn whose history sits on the
        decode worker that served it computes only its new tokens there."""
        hits = chain[2]
        own = hits.get(decode.worker_id, 0)
        pick = None
        for d, t in roomy:
            if (hits.get(d.worker_id, 0) <= own or d.fingerprint != decode.fingerprint
                    or (admission and t > slo_tbt_s)):
                continue
            e = self._estimate(d, chain, remote=False)
            budget = self._stall_budget(slo_tbt_s, e.step_s)
            if d.load and e.ttft_s - e.step_s > budget:
                continue
            key = (e.ttft_s, d.worker_id)
            if e.ttft_s < best.ttft_s and (pick is None or key < pick[0]):
                pick = (key, e, d, t)
        if pick is None:
            return best, decode, tbt, why
        _, e, d, t = pick
        return e, d, t, (f"local on the prefix's holder {e.ttft_s:.3f}s < "
                         f"{best.ttft_s:.3f}s ({why})")

    def _stall_budget(self, slo_tbt_s: float, step_s: float) -> float:
        """Seconds a local prefill may stall a running batch: what keeps the mean TBT of
        a running request of the workload's mean planned output (of the requests
        accepted so far; two tokens before any) within ``slo_tbt_s``, at most
        ``max_decode_stall_s``."""
        n, tokens = self._outputs
        spread = max(1.0, tokens / n - 1) if n else 1.0
        return min(self.config.max_decode_stall_s, (slo_tbt_s - step_s) * spread)

    def _pick_decode(self, decoders: list[WorkerView], prompt: int,
                     output: int) -> tuple[WorkerView, float, bool, list]:
        """Lowest predicted TBT among decode workers with room; with none, the roomiest.
        Also every worker with room, with its predicted TBT."""
        best_key, roomiest_key, best, roomiest = None, None, None, None
        roomy = []
        for d in decoders:
            local, kv_blocks, kv_tokens = self._unacked(d)
            free = d.unpromised_blocks - kv_blocks
            need = -(-(prompt + output) // d.block_size)
            batch = d.load + 1  # requests waiting for KV join it when their KV lands
            context = (d.num_blocks - d.free_blocks) * d.block_size + kv_tokens
            tbt = self.cost.predict_decode(batch, context + prompt + output // 2)
            local_s = self.cost.prefill_queue_time(d.waiting + local,
                                                   d.queued_prefill_tokens + d.pending_tokens)
            tbt += local_s / max(1, output - 1)  # its local prefills will stall this request
            tbt *= self._contention(d)  # the model is of a worker alone (contention.py)
            if free >= need:
                roomy.append((d, tbt))
                if best_key is None or (tbt, -free, d.worker_id) < best_key:
                    best_key, best = (tbt, -free, d.worker_id), (d, tbt)
            if roomiest_key is None or (-free, tbt, d.worker_id) < roomiest_key:
                roomiest_key, roomiest = (-free, tbt, d.worker_id), (d, tbt)
        if best is not None:
            return best[0], best[1], True, roomy
        return roomiest[0], roomiest[1], False, roomy

    def _estimate(self, w: WorkerView, chain: tuple, *, remote: bool) -> Estimate:
        prompt, block_size, hits, pool = chain
        cfg = self.config
        own = hits.get(w.worker_id, 0)
        fetch = max(0, pool - own)
        cached = min((own + fetch) * block_size, prompt - 1)
        uncached = prompt - cached
        t = self.cost.predict_prefill(uncached, cached)
        step = 0.0
        if fetch:
            t += pool_fetch_time(fetch, block_size * cfg.kv_bytes_per_token, cfg.pool_bandwidth)
        if remote:
            queue = self.cost.prefill_queue_time(w.waiting + w.pending_requests,
                                                 w.queued_prefill_tokens + w.pending_tokens)
        else:
            local, _, kv_tokens = self._unacked(w)
            ahead = w.waiting + local
            queue = self.cost.prefill_queue_time(ahead, w.queued_prefill_tokens + w.pending_tokens)
            batch = w.load
            if batch:  # the step in progress finishes first
                context = (w.num_blocks - w.free_blocks) * w.block_size + kv_tokens
                step = self.cost.predict_decode(batch, context)
                queue += step
                # Every prefill step here, of the prompts ahead and this one, also
                # advances the requests decoding: their decode rides along in it.
                # (Those awaiting KV decode only once it lands: the step above.)
                if w.running:
                    ride = self.cost.predict_decode(w.running, context)
                    queue += ahead * ride
                    t += ride
        # Compute on a host other workers keep busy runs slower: the profile's factor
        # for their number, this worker counted busy. The link transfer is not compute.
        c = self._contention(w)
        queue, t, step = queue * c, t * c, step * c
        if remote:
            t += transfer_time(prompt * cfg.kv_bytes_per_token, cfg.link_bandwidth)
        raw = queue + t
        f = self.correction.factor("remote" if remote else "local", w.worker_id)
        return Estimate(raw * f, w, own + fetch, uncached, queue, step, raw, f)

    def _contention(self, w: WorkerView) -> float:
        return host_factor(self.config.contention, busy_on_host(self._busy, w))

    def _account(self, best: Estimate, decode: WorkerView, kv_tokens: int,
                 ahead_s: float, r: PolicyRequest) -> None:
        # A worker whose heartbeats acknowledge requests counts this one until it does;
        # otherwise the anonymous counters and ledger, which its heartbeats reset.
        pre, rid, at = best.worker, r.request_id, r.routed_at
        local = pre is decode
        kv_blocks = -(-kv_tokens // decode.block_size)
        if rid and pre.acks:
            pre.route(rid, Inflight(best.uncached, local, kv_blocks if local else 0,
                                    kv_tokens if local else 0, at))
        else:
            pre.pending_requests += 1
            pre.pending_tokens += best.uncached
            if local:
                led = self._ledger(decode)
                led.local += 1
                led.kv_blocks += kv_blocks
                led.kv_tokens += kv_tokens
        if local:
            return
        if ahead_s > 0:  # the Prefill reaches it only after the decode's own prompts
            pre.hold_beats = HOLD_BEATS  # (what a heartbeat makes anonymous stays)
        if rid and decode.acks:
            decode.route(rid, Inflight(0, False, kv_blocks, kv_tokens, at))
        else:
            decode.pending_requests += 1
            led = self._ledger(decode)
            led.kv_blocks += kv_blocks
            led.kv_tokens += kv_tokens


def _times(factor: float, margin: float) -> str:
    """How a prediction was scaled, for a reason: the learned factor, the margin."""
    parts = [f"x{v:.2f} {name}" for name, v in (("learned", factor), ("margin", margin))
             if v != 1.0]
    return f" ({', '.join(parts)})" if parts else ""
