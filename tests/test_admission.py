"""Admission under a burst: what the conductor predicts for requests routed between two
heartbeats, how long such a decision stays counted, and what a worker reports while a
step runs."""

from __future__ import annotations

import asyncio
import re
import threading

from common.cost_profile import CostProfile
from common.protocol import Heartbeat
from common.sampling_params import SamplingParams
from services.conductor.cache_policy import Decision, Rejection
from services.conductor.registry import Registry
from services.engine.sim import SimEngine
from services.worker.engine_loop import EngineLoop
from tests.test_cache_policy import CAL, PROMPT, policy, prefill_s, route, view


def _ttft(decision: Decision) -> float:
    return float(re.search(r"ttft ([0-9.]+)s", decision.reason).group(1))


def _beat(wid: str, role: str, **load) -> Heartbeat:
    fields = dict(waiting=0, running=0, queued_prefill_tokens=0, free_blocks=100_000,
                  total_blocks=100_000, step_time_ms=0.0)
    return Heartbeat(worker_id=wid, role=role, seq=1, **{**fields, **load})


def test_burst_between_heartbeats_grows_the_predicted_ttft_until_the_slo_rejects():
    # Four running decodes: a full local prefill would stall them, so every request
    # goes to the one prefill worker, whose queue only the in-flight counters show.
    ws = [view("d1", "decode", running=4), view("p1", "prefill")]
    pol, slo = policy(), 4.0
    one = prefill_s(PROMPT, 0)
    admitted, rejection = [], None
    for i in range(20):
        d = route(pol, ws, hashes=[1000 + i], slo_ttft_s=slo)
        if isinstance(d, Rejection):
            rejection = d
            break
        assert d.prefill is ws[1]
        admitted.append(_ttft(d))
    assert len(admitted) == int(slo // one)  # 4 of ~0.86 s fit in 4 s
    assert all(b > a for a, b in zip(admitted, admitted[1:], strict=False))
    assert ws[1].pending_requests == len(admitted)
    predicted = float(re.search(r"TTFT ([0-9.]+)s", rejection.reason).group(1))
    assert predicted > slo
    # Retry when the queue ahead has drained below the target: at least a second.
    assert rejection.retry_after_s == max(1.0, predicted - slo)
    again = route(pol, ws, hashes=[999], slo_ttft_s=slo)  # a rejection accounts nothing
    assert isinstance(again, Rejection) and again.retry_after_s == rejection.retry_after_s


def test_a_decision_stays_counted_through_the_next_heartbeat_and_not_beyond():
    reg = Registry()
    ws = [view("d1", "decode", running=4), view("p1", "prefill")]
    for w in ws:
        reg.workers[w.worker_id] = w
    pol = policy()
    for i in range(3):
        assert isinstance(route(pol, ws, hashes=[i], slo_ttft_s=60), Decision)
    # The requests are still on their way: this heartbeat shows none of them.
    assert reg.heartbeat(_beat("p1", "prefill"), now=1.0)
    assert (ws[1].pending_requests, ws[1].pending_tokens) == (3, 3 * PROMPT)
    queued = _ttft(route(pol, ws, hashes=[10], slo_ttft_s=60))
    assert queued > 4 * prefill_s(PROMPT, 0)  # three ahead, then its own
    # The next heartbeat counts the first three itself; the fourth stays pending once.
    assert reg.heartbeat(_beat("p1", "prefill", waiting=4, queued_prefill_tokens=4 * PROMPT),
                         now=2.0)
    assert (ws[1].pending_requests, ws[1].pending_tokens) == (1, PROMPT)
    assert reg.heartbeat(_beat("p1", "prefill"), now=3.0)
    assert (ws[1].pending_requests, ws[1].pending_tokens) == (0, 0)
    # A decode worker gets its requests straight from the gateway: one heartbeat clears.
    assert ws[0].pending_requests == 4
    assert reg.heartbeat(_beat("d1", "decode", running=4), now=3.0)
    assert ws[0].pending_requests == 0


def test_local_prefill_queue_is_the_decode_workers_waiting_prompts_in_turn():
    # No prefill worker: five prompts wait on the decode worker, which prefills locally.
    ws = [view("d1", "decode", waiting=5, queued=5 * PROMPT)]
    d = route(policy(), ws, hashes=[], slo_ttft_s=60)
    assert d.prefill is None
    step = CAL.decode_fixed_s + 5 * CAL.decode_per_seq_s  # the step in progress
    assert abs(_ttft(d) - (6 * prefill_s(PROMPT, 0) + step)) < 2e-3


def test_engine_load_shows_the_requests_of_the_step_in_progress():
    profile = CostProfile("t", 0.01, 1e-4, 1e-7, 0.02, 1e-3, 1e-6, kv_bytes_per_token=64,
                          block_size=16, link_bandwidth=1e9)
    stepping, release = threading.Event(), threading.Event()

    def sleep(_seconds: float) -> None:
        stepping.set()
        release.wait(5)

    async def go():
        loop = EngineLoop(lambda outputs, step_s: None)
        await loop.start(lambda: SimEngine(profile, num_blocks=64, sleep=sleep))
        try:
            await loop.run(lambda e: e.add_request("a", list(range(1, 101)),
                                                   SamplingParams(max_tokens=1)))
            await asyncio.to_thread(stepping.wait, 5)
            return loop.load  # read while the step that prefills "a" runs
        finally:
            release.set()
            await loop.stop()
    load = asyncio.run(go())
    assert load.num_requests == 1 and load.waiting + load.running == 1
    assert load.queued_prefill_tokens == 100
