"""The simulator's heartbeats tell the conductor what the live workers' do: the requests
each worker took in (``Heartbeat.admitted``) and a decode worker's first-token times
(``TtftSample``), so a route by request id gets the per-request in-flight accounting
and the TTFT correction; on one shared host the policy sees one host id."""

from __future__ import annotations

import dataclasses

import pytest

from bench.sim.profiles import Profile
from bench.sim.simulator import SimRequest, Simulator
from common.cost_profile import load_profile
from common.records import CostCoefficients
from services.conductor.policy import Decision
from services.conductor.router import Router, RouteRequest
from services.conductor.server import ConductorSettings

# prefill(n, c) = 0.1 + 1e-3 n + 1e-6 n (n/2 + c); step(B, K) = 0.01 + 1e-3 B + 1e-5 K;
# 1000 B of KV per token over 1 MB/s: 1 s per 1000-token prompt.
TINY = Profile(name="tiny", cost=CostCoefficients(0.1, 1e-3, 1e-6, 0.01, 1e-3, 1e-5),
               kv_bytes_per_token=1000, block_size=512, kv_blocks=100,
               link_bandwidth=1e6, pool_bandwidth=1e6)


def fixed(prefill: str | None):
    def route(views, req):
        by_id = {v.worker_id: v for v in views}
        return Decision(by_id["decode-0"], by_id[prefill] if prefill else None, "fixed")
    return route


def recorded(sim: Simulator) -> list:
    beats, apply = [], sim.registry.heartbeat

    def heartbeat(hb, now=None):
        beats.append((now, hb))
        return apply(hb, now=now)
    sim.registry.heartbeat = heartbeat
    return beats


@pytest.mark.parametrize("interval", [1.0, 5.0])
def test_heartbeats_acknowledge_requests_taken_in_and_report_first_token_times(interval):
    # a: first token 2.6, done 2.64201; b: first token 3.6, done 3.621 (hand-checked in
    # test_simulator.py). At 5 s both have finished before the first heartbeat: the
    # live snapshot, taken after every step, saw them, so it acknowledges them still.
    a = SimRequest(0, 0.0, 1000, 3, [0, 1])
    b = SimRequest(1, 0.5, 1000, 2, [0, 2])
    sim = Simulator(TINY, fixed("prefill-0"), prefill=1, decode=1, heartbeat_s=interval)
    beats = recorded(sim)
    sim.run([a, b])
    acked = {w: [rid for _, hb in beats if hb.worker_id == w for rid in hb.admitted]
             for w in ("prefill-0", "decode-0")}
    assert acked == {"prefill-0": ["0", "1"], "decode-0": ["0", "1"]}
    samples = [(now, s) for now, hb in beats for s in hb.ttft_samples]
    assert [(s.request_id, s.remote) for _, s in samples] == [("0", True), ("1", True)]
    assert [s.seconds for _, s in samples] == pytest.approx([2.6, 3.1])
    # Reported only at a heartbeat after the first token, never before.
    assert all(now >= 2.6 for now, _ in samples)
    assert all(hb.admitted == [] for now, hb in beats if now > 1.0 and interval == 1.0)


def test_a_local_prefill_reports_its_first_token_as_local():
    a = SimRequest(0, 0.0, 1000, 3, [0, 1])
    sim = Simulator(TINY, fixed(None), prefill=0, decode=1, heartbeat_s=1.0)
    beats = recorded(sim)
    sim.run([a])
    # prefill 0.1 + 1.0 + 0.5 on the decode worker itself, no transfer.
    samples = [s for _, hb in beats for s in hb.ttft_samples]
    assert [(s.request_id, s.remote) for s in samples] == [("0", False)]
    assert samples[0].seconds == pytest.approx(1.6)


def test_a_route_by_request_id_is_counted_until_acknowledged_and_feeds_the_correction():
    cp = load_profile("smollm2-cpu")
    router = Router(ConductorSettings(policy="cache_aware").router_config(), cp)
    true = Profile.from_cost_profile(cp, kv_blocks=4000)
    seen: dict[int, dict[str, list[str]]] = {}

    def route(views, req):
        seen[req.rid] = {v.worker_id: sorted(v.inflight) for v in views if v.inflight}
        return router.route(views, RouteRequest("sim", req.prompt, req.hashes,
                                                max_tokens=req.output),
                            req.request_id, now=req.arrival)
    # Three arrivals before the first heartbeat (0.2 s), then one a heartbeat apart.
    times = [0.0, 0.05, 0.1, 1.0, 2.0, 3.0, 4.0, 5.0]
    reqs = [SimRequest(i, t, 200, 40, [100 * i + k for k in range(12)])
            for i, t in enumerate(times)]
    sim = Simulator(true, route, prefill=1, decode=1, index=router.index, cost=router.cost,
                    heartbeat_s=0.2, correction=router.correction)
    sim.run(reqs)
    # Before any heartbeat each earlier request is still counted where it went: 0
    # prefilled on the decode worker, 1 on the prefill worker (its KV reserved there).
    assert seen[1] == {"decode-0": ["0"]}
    assert seen[2] == {"decode-0": ["0", "1"], "prefill-0": ["1"]}
    assert seen[3] == {} and seen[7] == {}  # acknowledged by the heartbeats since
    c = router.correction
    assert c.unmatched == 0
    assert c.used >= 7 and c.used + c.pending == len(reqs)
    assert sum(f.samples for f in c.factors() if f.worker_id == "*") == c.used


def test_on_a_shared_host_the_policy_sees_one_host():
    apart = Simulator(TINY, fixed(None), prefill=2, decode=1)
    shared = Simulator(dataclasses.replace(TINY, contention=(1.0, 2.0)), fixed(None),
                       prefill=2, decode=1, shared_host=True)
    assert sorted(v.host_id for v in apart.views) == ["decode-0", "prefill-0", "prefill-1"]
    assert {v.host_id for v in shared.views} == {"host"}
