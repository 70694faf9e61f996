"""The conductor's view of the workers: who exists, how loaded, who is alive, and whom
it refused (a worker whose KV cannot be exchanged with its model's others)."""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple

import structlog

from common.protocol import WorkerInfo, WorkerRefusal, WorkerStatus
from services.conductor.compat import Mismatch, mismatch

log = structlog.get_logger(__name__)

MISSED_HEARTBEATS_DEAD = 3
REFUSALS_KEPT = 16  # the latest refusals, one per worker id, for stats and /health
# How long a decision stays counted when its worker never acknowledges it (the request
# never reached it: a gateway gone, a refusal upstream); the conductor passes its KV
# lease, which bounds how late a Prefill may reach its prefill worker.
INFLIGHT_TTL_S = 10.0


# A heartbeat's counts are held to [0, MAX_COUNT] and its step time to a finite >= 0: one
# decode worker reporting a negative load made every route fail (the cost model refuses
# a negative batch), and one reporting huge free blocks drew every request.
MAX_COUNT = 1 << 40
_COUNTS = ("waiting", "running", "queued_prefill_tokens", "free_blocks", "total_blocks",
           "waiting_for_kv", "reserved_blocks")


def is_count(v) -> bool:
    """An int >= 0 (not a bool): what a worker's counts must be."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def is_finite_time(v) -> bool:
    """A finite number >= 0 (not a bool): what a worker's times must be."""
    return not isinstance(v, bool) and isinstance(v, int | float) and 0 <= v < math.inf


def heartbeat_problem(hb) -> str | None:
    """Why ``hb``'s load figures cannot be true, or None."""
    for name in _COUNTS:
        value = getattr(hb, name)
        if not is_count(value) or value > MAX_COUNT:
            return f"{name} must be an int in [0, {MAX_COUNT}], got {value!r}"
    if not is_finite_time(hb.step_time_ms):
        return f"step_time_ms must be a finite number >= 0, got {hb.step_time_ms!r}"
    if hb.free_blocks > hb.total_blocks:
        return f"free_blocks {hb.free_blocks} > total_blocks {hb.total_blocks}"
    return None


class Inflight(NamedTuple):
    """A decision routed to a worker that its heartbeats do not show yet."""

    tokens: int  # prompt tokens it will prefill there (0: it only decodes there)
    local: bool  # prefilled on this decode worker
    kv_blocks: int  # KV blocks it takes on this decode worker (0 on a prefill worker)
    kv_tokens: int
    at: float  # when it was routed (monotonic)


@dataclass(slots=True)
class WorkerView:
    """A registered worker: what it said in Hello (``info``) and its load and liveness
    since. The info's fields read as attributes of the view (``w.role``, ``w.block_size``)."""

    info: WorkerInfo
    last_seen: float = field(default_factory=time.monotonic)
    alive: bool = True
    leaving: bool = False  # said Leaving: its heartbeats until it exits do not revive it
    waiting: int = 0
    running: int = 0
    queued_prefill_tokens: int = 0
    free_blocks: int = 0
    step_time_ms: float = 0.0
    waiting_for_kv: int = 0  # remote prefills whose KV has not landed (a decode worker's)
    reserved_blocks: int = 0  # blocks its held requests will still take for their output
    # Decisions the worker's counters may not show yet (see ``Registry.heartbeat``).
    pending_requests: int = 0
    pending_tokens: int = 0
    # Of those, the ones already pending at the last heartbeat: the next one drops them.
    carried_requests: int = 0
    carried_tokens: int = 0
    # Heartbeats of a prefill worker that keep all its pending decisions: some reach it
    # late, behind prompts their decode worker prefills itself (``Registry.heartbeat``).
    hold_beats: int = 0
    # Decisions routed here by request id, kept until a heartbeat acknowledges them
    # (``Heartbeat.admitted``): they are also in ``pending_requests``/``pending_tokens``.
    inflight: dict[str, Inflight] = field(default_factory=dict)
    # Its heartbeats acknowledge requests (carry ``admitted``); assumed until one says
    # otherwise, so the burst before its first heartbeat lands is counted too.
    acks: bool = True

    @property
    def load(self) -> int:
        return self.running + self.waiting + self.waiting_for_kv + self.pending_requests

    def inflight_sum(self, field_name: str) -> int:
        """One field of the in-flight decisions, summed (``local`` counts them)."""
        return sum(getattr(e, field_name) for e in self.inflight.values())

    def route(self, request_id: str, entry: Inflight) -> None:
        """Count a decision for ``request_id`` here until a heartbeat acknowledges it."""
        old = self.inflight.pop(request_id, None)
        if old is not None:  # the same id routed again: counted once
            self.pending_requests -= 1
            self.pending_tokens -= old.tokens
        self.inflight[request_id] = entry
        self.pending_requests += 1
        self.pending_tokens += entry.tokens

    @property
    def unpromised_blocks(self) -> int:
        """Free KV blocks not spoken for by the output of the requests it holds."""
        return max(0, self.free_blocks - self.reserved_blocks)

    worker_id = property(lambda self: self.info.worker_id)
    role = property(lambda self: self.info.role)
    model = property(lambda self: self.info.model)
    control_addr = property(lambda self: self.info.control_addr)
    kv_addr = property(lambda self: self.info.kv_addr)
    host_id = property(lambda self: self.info.host_id)
    block_size = property(lambda self: self.info.block_size)
    num_blocks = property(lambda self: self.info.num_blocks)
    fingerprint = property(lambda self: self.info.fingerprint)

    def status(self) -> WorkerStatus:
        return WorkerStatus(info=self.info, alive=self.alive, waiting=self.waiting,
                            running=self.running,
                            queued_prefill_tokens=self.queued_prefill_tokens,
                            free_blocks=self.free_blocks, step_time_ms=self.step_time_ms)


class Registry:
    def __init__(self, heartbeat_interval_s: float = 1.0,
                 inflight_ttl_s: float = INFLIGHT_TTL_S) -> None:
        self.interval = heartbeat_interval_s
        self.inflight_ttl_s = max(inflight_ttl_s, MISSED_HEARTBEATS_DEAD * heartbeat_interval_s)
        self.workers: dict[str, WorkerView] = {}
        self.refused: OrderedDict[str, WorkerRefusal] = OrderedDict()

    def admit(self, view: WorkerView) -> Mismatch | None:
        """Register ``view`` unless its KV settings differ from its model's reference
        worker (see ``services/conductor/compat.py``); then remember the refusal and
        return what differs. A worker admitted later under the same id is forgotten as
        refused."""
        reference = next((w for w in self.workers.values()
                          if w.model == view.model and w.alive
                          and w.worker_id != view.worker_id), None)
        found = mismatch(reference.info, view.info) if reference is not None else None
        if found is None:
            self.refused.pop(view.worker_id, None)
            self.register(view)
            return None
        self.refused.pop(view.worker_id, None)  # the latest goes last
        self.refused[view.worker_id] = WorkerRefusal(
            worker_id=view.worker_id, role=view.role, model=view.model, setting=found.field,
            reason=found.reason, at=time.time())
        while len(self.refused) > REFUSALS_KEPT:
            self.refused.popitem(last=False)
        return found

    def refusals(self, model: str = "") -> list[WorkerRefusal]:
        """The refusals kept, oldest first; only ``model``'s when it is given."""
        return [r for r in self.refused.values() if not model or r.model == model]

    def register(self, view: WorkerView) -> None:
        known = view.worker_id in self.workers
        view.free_blocks = view.free_blocks or view.num_blocks
        self.workers[view.worker_id] = view
        log.info("worker registered" if not known else "worker re-registered",
                 worker_id=view.worker_id, role=view.role, control=view.control_addr)

    def heartbeat(self, hb, now: float | None = None) -> bool:
        """Apply a heartbeat; False if the worker is unknown (it must be rediscovered).

        A remote prefill reaches its prefill worker well after the decision: the decode
        worker forwards it only once it has reserved blocks, between its engine steps,
        which a long local prefill step delays. So a prefill worker's heartbeat need not
        count the decisions made just before it: on a prefill worker each decision stays
        pending through the first heartbeat after it and is dropped at the second. For
        up to one interval it may be counted twice, which errs towards refusing rather
        than towards admitting a burst that a heartbeat hid. A decode worker receives
        its requests directly and shows them in its next load snapshot: its heartbeat
        clears them.

        A decode worker busy prefilling prompts of its own holds a remote prefill back
        until its step ends, which can be longer than an interval: the policy then sets
        ``hold_beats`` and the prefill worker keeps all its pending decisions through
        that many more heartbeats. Counted in heartbeats, not seconds, so that a replay
        of the same heartbeats (the simulator, a test) decides the same.

        Decisions made with a request id on a worker whose heartbeats carry ``admitted``
        (``WorkerView.route``; the policy's choice) are exact instead: each
        stays counted until a heartbeat lists its id in ``admitted`` (the worker's engine
        took it in, so this heartbeat's own counts include it or it already finished),
        or ``inflight_ttl_s`` after it was routed (it never arrived). A heartbeat sent
        before the request reached the worker, however late it lands here, leaves it
        counted."""
        view = self.workers.get(hb.worker_id)
        if view is None:
            return False
        problem = heartbeat_problem(hb)
        if problem is not None:  # not applied, not even as a sign of life
            raise ValueError(f"heartbeat of {hb.worker_id}: {problem}")
        now = time.monotonic() if now is None else now
        view.last_seen = now
        if view.leaving:
            return True
        if not view.alive:
            log.info("worker back", worker_id=view.worker_id)
        view.alive = True
        view.waiting, view.running = hb.waiting, hb.running
        view.queued_prefill_tokens = hb.queued_prefill_tokens
        view.free_blocks, view.step_time_ms = hb.free_blocks, hb.step_time_ms
        view.waiting_for_kv, view.reserved_blocks = hb.waiting_for_kv, hb.reserved_blocks
        inflight = view.inflight
        admitted = getattr(hb, "admitted", None)
        view.acks = admitted is not None
        if not view.acks:  # it never will: what it was counted for is anonymous now
            inflight.clear()
        # The anonymous decisions (no request id) are what the counters hold beyond
        # the in-flight entries; only they follow the heartbeat-counting rules below.
        requests = view.pending_requests - len(inflight)
        tokens = view.pending_tokens - view.inflight_sum("tokens")
        for rid in admitted or ():
            inflight.pop(rid, None)
        horizon = now - self.inflight_ttl_s
        for rid in [rid for rid, e in inflight.items() if e.at < horizon]:
            del inflight[rid]
        carry = view.role == "prefill"
        if carry and view.hold_beats > 0:
            view.hold_beats -= 1
            view.carried_requests, view.carried_tokens = requests, tokens
        else:
            requests = max(0, requests - view.carried_requests) if carry else 0
            tokens = max(0, tokens - view.carried_tokens) if carry else 0
            view.carried_requests, view.carried_tokens = requests, tokens
        view.pending_requests = requests + len(inflight)
        view.pending_tokens = tokens + view.inflight_sum("tokens")
        return True

    def leave(self, worker_id: str) -> bool:
        """A planned stop: route nothing more to ``worker_id`` until it says Hello again.
        False if the worker is unknown."""
        view = self.workers.get(worker_id)
        if view is None:
            return False
        view.alive, view.leaving = False, True
        log.info("worker leaving", worker_id=worker_id)
        return True

    def reap(self, now: float | None = None) -> list[str]:
        """Mark workers that missed 3 heartbeats dead; returns the newly dead."""
        now = time.monotonic() if now is None else now
        dead = []
        for view in self.workers.values():
            if view.alive and now - view.last_seen > MISSED_HEARTBEATS_DEAD * self.interval:
                view.alive = False
                dead.append(view.worker_id)
                log.warning("worker dead", worker_id=view.worker_id,
                            silent_s=round(now - view.last_seen, 2))
        return dead

    def alive(self, roles: tuple[str, ...]) -> list[WorkerView]:
        return [w for w in self.workers.values() if w.alive and w.role in roles]
