"""Work the conductor routed but no heartbeat has acknowledged stays counted: a heartbeat
sent before a request reached its worker does not hide it, one that lists it
(``Heartbeat.admitted``) hands it over to the worker's own counts, and one that never
comes ages it out after the KV lease. The worker side: a heartbeat acknowledges exactly
the requests its load snapshot counts."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest

from common.cost_profile import CostProfile
from common.protocol import Heartbeat
from common.sampling_params import SamplingParams
from services.conductor.cache_policy import Decision
from services.conductor.registry import Registry
from services.engine.sim import SimEngine
from services.worker.engine_loop import EngineLoop
from tests.test_cache_policy import PROMPT, STEP4, policy, prefill_s, route, view

T0 = 1000.0  # the routing clock (monotonic seconds) of these tests


def _beat(wid: str, role: str, admitted=(), **load) -> Heartbeat:
    fields = dict(waiting=0, running=0, queued_prefill_tokens=0, free_blocks=100_000,
                  total_blocks=100_000, step_time_ms=0.0)
    return Heartbeat(worker_id=wid, role=role, seq=1, admitted=list(admitted),
                     **{**fields, **load})


def _setup(*ws):
    """A registry of ``ws``, each having sent one heartbeat that acknowledges (none)."""
    reg = Registry(heartbeat_interval_s=1.0, inflight_ttl_s=10.0)
    for w in ws:
        reg.workers[w.worker_id] = w
        load = dict(running=w.running, waiting=w.waiting,
                    queued_prefill_tokens=w.queued_prefill_tokens)
        assert reg.heartbeat(_beat(w.worker_id, w.role, **load), now=T0 - 0.5)
        assert w.acks
    return reg


def test_a_heartbeat_between_two_requests_does_not_hide_the_first():
    # Run 2 of the overload burst: the second request was predicted an empty queue
    # because a heartbeat sent before the first arrived replaced the conductor's count.
    d1 = view("d1", "decode")
    reg, pol = _setup(d1), policy()
    first = route(pol, [d1], hashes=[], slo_ttft_s=60, request_id="r1", routed_at=T0)
    assert isinstance(first, Decision) and first.prefill is None
    assert first.predicted_ttft_s == pytest.approx(prefill_s(PROMPT, 0))
    # Sent before r1 reached d1: nothing waiting there, nothing acknowledged.
    assert reg.heartbeat(_beat("d1", "decode"), now=T0 + 0.05)
    assert (d1.pending_requests, d1.pending_tokens) == (1, PROMPT)
    second = route(pol, [d1], hashes=[], slo_ttft_s=60, request_id="r2", routed_at=T0 + 0.1)
    # Its queue is r1's whole prefill and one decode step of r1 (its KV counted).
    step1 = 0.02 + 1e-3 + 1e-7 * PROMPT
    assert second.predicted_ttft_s == pytest.approx(2 * prefill_s(PROMPT, 0) + step1)
    assert f"queue {prefill_s(PROMPT, 0) + step1:.3f}s" in second.reason
    # The heartbeat that counts r1 itself acknowledges it: counted once, by the worker.
    assert reg.heartbeat(_beat("d1", "decode", ["r1"], waiting=1,
                               queued_prefill_tokens=PROMPT), now=T0 + 1.0)
    assert (d1.pending_requests, d1.pending_tokens) == (1, PROMPT)  # r2 only
    third = route(pol, [d1], hashes=[], slo_ttft_s=60, request_id="r3", routed_at=T0 + 1.1)
    step2 = 0.02 + 2e-3 + 1e-7 * PROMPT  # r1 waits: none of its blocks taken yet
    assert third.predicted_ttft_s == pytest.approx(3 * prefill_s(PROMPT, 0) + step2)
    assert reg.heartbeat(_beat("d1", "decode", ["r2", "r3"], waiting=2,
                               queued_prefill_tokens=2 * PROMPT), now=T0 + 2.0)
    assert (d1.pending_requests, d1.pending_tokens) == (0, 0) and not d1.inflight


def test_remote_decisions_stay_on_the_prefill_worker_until_it_acknowledges_them():
    d1, p1 = view("d1", "decode", running=4), view("p1", "prefill")
    reg, pol = _setup(d1, p1), policy()
    for i in range(3):
        d = route(pol, [d1, p1], hashes=[i], slo_ttft_s=60, request_id=f"r{i}",
                  routed_at=T0 + 0.1 * i)
        assert d.prefill is p1
    # The decode worker got all three (waiting for KV); the prefill worker none yet,
    # through more heartbeats than the anonymous rule would keep them.
    assert reg.heartbeat(_beat("d1", "decode", ["r0", "r1", "r2"], running=4,
                               waiting_for_kv=3), now=T0 + 0.5)
    assert (d1.pending_requests, len(d1.inflight)) == (0, 0)
    for k in range(3):
        assert reg.heartbeat(_beat("p1", "prefill"), now=T0 + 1 + k)
        assert (p1.pending_requests, p1.pending_tokens) == (3, 3 * PROMPT)
    # The fourth sees three prompts ahead of its own on p1, and d1's step first.
    fourth = route(pol, [d1, p1], hashes=[9], slo_ttft_s=60, request_id="r9",
                   routed_at=T0 + 3.5)
    assert fourth.prefill is p1
    assert fourth.predicted_ttft_s == pytest.approx(
        4 * prefill_s(PROMPT, 0) + PROMPT * 1000 / 1e9 + STEP4 + 1e-3, rel=0.02)
    assert reg.heartbeat(_beat("p1", "prefill", ["r0", "r1"], waiting=1,
                               queued_prefill_tokens=PROMPT), now=T0 + 4)
    assert (p1.pending_requests, p1.pending_tokens) == (2, 2 * PROMPT)  # r2, r9
    assert set(p1.inflight) == {"r2", "r9"}


def test_an_unacknowledged_decision_ages_out_after_the_ttl_and_a_reroute_counts_once():
    d1 = view("d1", "decode")
    reg, pol = _setup(d1), policy()
    route(pol, [d1], hashes=[], slo_ttft_s=60, request_id="lost", routed_at=T0)
    route(pol, [d1], hashes=[], slo_ttft_s=60, request_id="again", routed_at=T0 + 5)
    route(pol, [d1], hashes=[], slo_ttft_s=60, request_id="again", routed_at=T0 + 6)
    assert (d1.pending_requests, d1.pending_tokens) == (2, 2 * PROMPT)
    assert reg.heartbeat(_beat("d1", "decode"), now=T0 + 9.9)
    assert set(d1.inflight) == {"lost", "again"}
    assert reg.heartbeat(_beat("d1", "decode", ["unknown"]), now=T0 + 10.5)
    assert list(d1.inflight) == ["again"] and d1.pending_requests == 1
    assert reg.heartbeat(_beat("d1", "decode"), now=T0 + 16.5)
    assert (d1.pending_requests, d1.pending_tokens) == (0, 0)


def test_a_heartbeat_acknowledges_only_what_its_load_snapshot_counts():
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
            params = SamplingParams(max_tokens=4)
            await loop.run(lambda e: e.add_request("a", list(range(1, 101)), params))
            await asyncio.to_thread(stepping.wait, 5)
            during = loop.load  # the step prefilling "a" runs
            got = [loop.take_admitted(during), loop.take_admitted(during)]
            # "b" arrives while that step runs: the snapshot a heartbeat would carry
            # now does not count it, so nor does the acknowledgement.
            added = asyncio.ensure_future(loop.run(
                lambda e: e.add_request("b", list(range(1, 51)), params)))
            await asyncio.sleep(0.05)
            got.append(loop.take_admitted(loop.load))
            release.set()
            await added
            for _ in range(500):  # the snapshot after the command, before the next step
                if loop.load.admitted == 2:
                    break
                await asyncio.sleep(0.01)
            got.append(loop.take_admitted(loop.load))
            return during, got
        finally:
            release.set()
            await loop.stop()
    during, got = asyncio.run(go())
    assert during.admitted == 1 and during.queued_prefill_tokens == 100
    assert got == [["a"], [], [], ["b"]]


def test_a_worker_is_taken_to_acknowledge_until_a_heartbeat_says_otherwise():
    # The burst may come before a new worker's first heartbeat lands.
    d1, d2 = view("d1", "decode"), view("d2", "decode")
    reg, pol = Registry(heartbeat_interval_s=1.0, inflight_ttl_s=10.0), policy()
    reg.workers.update(d1=d1, d2=d2)
    for w in (d1, d2):
        route(pol, [w], hashes=[], slo_ttft_s=60, request_id=f"{w.worker_id}-a", routed_at=T0)
        assert list(w.inflight) == [f"{w.worker_id}-a"] and w.pending_requests == 1
    assert reg.heartbeat(_beat("d1", "decode"), now=T0 + 0.05)  # acknowledges: kept
    assert d1.acks and d1.pending_requests == 1
    # d2's heartbeats carry no acknowledgements: its count is the anonymous kind now,
    # which a decode worker's heartbeat clears (it shows its requests itself).
    legacy = dataclasses.replace(_beat("d2", "decode"), admitted=None)
    assert reg.heartbeat(legacy, now=T0 + 0.05)
    assert not d2.acks and not d2.inflight and d2.pending_requests == 0
    route(pol, [d2], hashes=[], slo_ttft_s=60, request_id="d2-b", routed_at=T0 + 0.1)
    assert not d2.inflight and d2.pending_requests == 1
