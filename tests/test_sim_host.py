"""Workers sharing one host: the profile's contention factors and per-token serving
overhead (common/cost_profile.py), how the simulator applies them when told the workers
share a host and ignores them otherwise, and bench/calibrate_host.py's overhead fit."""

from __future__ import annotations

import dataclasses
import json

import pytest

from bench.calibrate_host import alone_ratio, chained, kind_medians, overhead_fit
from common.cost_profile import CostProfile, load_profile, profile_from_dict, save_profile
from common.records import CostCoefficients
from services.advisor import search
from services.conductor.policy import Decision
from services.sim.profiles import Profile
from services.sim.simulator import SimRequest, Simulator

COST = CostCoefficients(0.1, 1e-3, 1e-6, 0.01, 1e-3, 1e-5)  # prefill(1000) = 1.6 s
HOST = Profile(name="host", cost=COST, kv_bytes_per_token=1000, block_size=512,
               kv_blocks=100, link_bandwidth=1e6, pool_bandwidth=1e6,
               contention=(1.0, 1.5, 2.0), token_overhead_s=0.02)


def cost_profile(**kw) -> CostProfile:
    base = dict(name="p", prefill_fixed_s=0.1, prefill_per_token_s=1e-3,
                prefill_per_pair_s=1e-6, decode_fixed_s=0.01, decode_per_seq_s=1e-3,
                decode_per_ctx_token_s=1e-5, kv_bytes_per_token=1000, block_size=16,
                link_bandwidth=1e6)
    return CostProfile(**{**base, **kw})


def test_contention_factor_per_number_of_busy_workers():
    cp = cost_profile(contention=[1.0, 1.6, 2.4], token_overhead_s=0.005)
    assert cp.contention == (1.0, 1.6, 2.4)
    assert [cp.contended(k) for k in (0, 1, 2, 3, 4, 9)] == [1.0, 1.0, 1.6, 2.4, 2.4, 2.4]
    # The engine's step is unchanged; served: x1.6 with two busy, + 5 ms per sequence.
    assert cp.decode_step_s(4, 1000) == pytest.approx(0.01 + 0.004 + 0.01)
    assert cp.served_decode_step_s(4, 1000, busy=2) == pytest.approx(0.024 * 1.6 + 0.02)
    assert cp.served_decode_step_s(4, 1000) == pytest.approx(0.024 + 0.02)
    assert cp.served_decode_step_s(0, 1000, busy=2) == 0.0
    assert cost_profile().contended(5) == 1.0  # not measured: no factor
    # A host slower than the one the steps were fitted on: one busy worker is x1.2 too.
    slow = cost_profile(contention=[1.2, 1.8])
    assert [slow.contended(k) for k in (0, 1, 2, 3)] == [1.2, 1.2, 1.8, 1.8]
    assert slow.served_decode_step_s(4, 1000) == pytest.approx(0.024 * 1.2)


@pytest.mark.parametrize("bad", [[0.9, 1.2], [1.0, 1.5, 1.2], [1.0, "2"], [True], 1.5])
def test_contention_must_be_factors_of_at_least_one_that_do_not_fall(bad):
    with pytest.raises(ValueError, match="contention"):
        profile_from_dict({**cost_profile().to_json(), "contention": bad}, "f.json")


def test_token_overhead_must_not_be_negative():
    with pytest.raises(ValueError, match="token_overhead_s"):
        cost_profile(token_overhead_s=-0.001)


def test_host_fields_round_trip_through_the_file_and_reach_the_simulated_worker(tmp_path):
    path = save_profile(cost_profile(contention=(1.0, 1.7), token_overhead_s=0.003),
                        tmp_path / "p.json")
    assert json.loads(path.read_text())["contention"] == [1.0, 1.7]
    cp = load_profile(str(path))
    assert (cp.contention, cp.token_overhead_s) == ((1.0, 1.7), 0.003)
    prof = Profile.from_cost_profile(cp, kv_blocks=10)
    assert (prof.contention, prof.token_overhead_s, prof.contended(2)) == ((1.0, 1.7), 0.003,
                                                                          1.7)
    # An older file without them still loads: no contention, no overhead.
    old = {k: v for k, v in cp.to_json().items() if k not in ("contention", "token_overhead_s")}
    assert profile_from_dict(old).contended(2) == 1.0


def test_shipped_profile_carries_host_measurements():
    cp = load_profile("smollm2-cpu")
    assert len(cp.contention) >= 2 and 1.0 <= cp.contention[0] < cp.contention[1]
    assert cp.token_overhead_s >= 0
    assert len(cp.fit["host"]["contention"]) >= 5  # 5 points per k measured
    assert "host" in cp.fit


def two_local(shared_host: bool) -> list[SimRequest]:
    """Two 1000-token prompts at t=0, one per decode worker, each prefilled where it
    decodes, 3 output tokens."""
    def route(views, req):
        by_id = {v.worker_id: v for v in views}
        return Decision(by_id[f"decode-{req.rid}"], None, "fixed")
    reqs = [SimRequest(i, 0.0, 1000, 3, [10 * i, 10 * i + 1]) for i in range(2)]
    Simulator(HOST, route, prefill=0, decode=2, shared_host=shared_host).run(reqs)
    return reqs


def test_shared_host_slows_work_by_the_processes_busy_when_it_starts():
    r0, r1 = two_local(shared_host=True)
    # decode-0 starts its prefill alone: the serving processes wait on sockets and
    # stream no token yet, so they are no busy process (x1.0, where they used to count
    # as a whole one, x1.5); decode-1 starts while decode-0 is busy: x1.5 (not x2.0).
    assert r0.ttft == pytest.approx(1.6 * 1.0)
    assert r1.ttft == pytest.approx(1.6 * 1.5)
    # decode-0's steps run while decode-1 still prefills, and its own tokens keep the
    # serving processes busy a share of a core: 1 / 41 ms tokens a second x 20 ms =
    # 0.488 of a process, so 2.488 busy: x(1.5 + 0.488 x 0.5), plus 20 ms a token.
    share = 0.02 / 0.041
    f0 = 1.5 + share * 0.5
    assert r0.tbt == pytest.approx(0.021 * f0 + 0.02 + 1e-5 * f0 / 2)
    # decode-1's steps start after decode-0 has finished: beside its own serving share.
    assert r0.done < r1.first_token
    f1 = 1.0 + share * 0.5
    assert r1.tbt == pytest.approx(0.021 * f1 + 0.02 + 1e-5 * f1 / 2)


def test_serving_share_is_linear_between_whole_numbers_of_busy_processes():
    assert [HOST.contended(k) for k in (0, 1, 1.25, 2, 2.5, 3, 4.5)] == \
        pytest.approx([1.0, 1.0, 1.125, 1.5, 1.75, 2.0, 2.0])
    # No token overhead measured: the serving processes add nothing.
    quiet = dataclasses.replace(HOST, token_overhead_s=0.0)
    reqs = [SimRequest(i, 0.0, 1000, 3, [10 * i, 10 * i + 1]) for i in range(2)]
    by = lambda views, req: Decision({v.worker_id: v for v in views}[  # noqa: E731
        f"decode-{req.rid}"], None, "fixed")
    Simulator(quiet, by, prefill=0, decode=2, shared_host=True).run(reqs)
    assert reqs[0].tbt == pytest.approx(0.021 * 1.5 + 1e-5 * 1.5 / 2)


def test_without_shared_host_the_host_fields_change_nothing():
    r0, r1 = two_local(shared_host=False)
    assert r0.ttft == pytest.approx(1.6) and r1.ttft == pytest.approx(1.6)
    assert r0.tbt == pytest.approx(0.021 + 1e-5 / 2) == pytest.approx(r1.tbt)


def test_the_advisor_plan_passes_shared_host_to_the_simulator():
    prof = dataclasses.replace(HOST, block_size=16, kv_blocks=1000)
    reqs = lambda: [SimRequest(i, 0.0, 1000, 3, list(range(100 * i, 100 * i + 62)))  # noqa: E731
                    for i in range(2)]
    outcomes = {}
    for shared in (False, True):
        plan = search.Plan("smollm2-cpu", prof, search.Slo(2.0, 1.0), 256,
                           shared_host=shared)
        outcomes[shared] = search.evaluate(search.Deployment(0, 2, False), reqs(), plan)
    # Alone each prompt meets a 2.0 s TTFT; on one host the first prefills alone (1.6 s)
    # and the second beside it, x1.5 (2.4 s).
    assert (outcomes[False].good, outcomes[True].good) == (2, 1)
    assert outcomes[True].ttft_s["p90"] == pytest.approx(1.6 * 1.5)


def test_overhead_fit_recovers_a_per_sequence_overhead():
    # tpot = step + B*o with o = 12 ms exactly: the fit returns it.
    rows = [(1, 0.05 + 0.012, 0.05), (4, 0.08 + 0.048, 0.08), (16, 0.2 + 0.192, 0.2)]
    assert overhead_fit(rows) == pytest.approx(0.012)
    # A client faster than the engine alone (noise) is no negative overhead.
    assert overhead_fit([(1, 0.04, 0.05)]) == 0.0
    # Rows that disagree (10 ms a sequence at B=1, 20 ms at B=4): weighted by relative
    # error, between the two, nearer the larger batch's.
    o = overhead_fit([(1, 0.06, 0.05), (4, 0.18, 0.10)])
    assert o == pytest.approx(0.016399, rel=1e-4)


def test_the_simulated_decode_step_follows_the_calibrated_points_not_the_fit():
    # Measured steps 10 % under the fit at B = 1 and 20 % over it at B = 4 and 16 (two
    # contexts at 4: the median of their ratios); between them linear in log(batch).
    cp = cost_profile(fit={"decode": [[1, 100, 0.9 * 0.012, 0.0], [4, 100, 1.1 * 0.015, 0.0],
                                      [4, 300, 1.3 * 0.017, 0.0], [16, 100, 1.2 * 0.027, 0.0],
                                      ["bad row"]]})
    prof = Profile.from_cost_profile(cp, kv_blocks=10)
    assert [b for b, _ in prof.decode_shape] == [1, 4, 16]
    assert [r for _, r in prof.decode_shape] == pytest.approx([0.9, 1.2, 1.2])
    assert prof.decode_step_s(1, 100) == pytest.approx(0.9 * 0.012)
    assert prof.decode_step_s(2, 100) == pytest.approx(1.05 * cp.decode_step_s(2, 100))
    assert prof.decode_step_s(64, 100) == pytest.approx(1.2 * cp.decode_step_s(64, 100))
    # What the engine reports and the conductor fits stays the fit's.
    assert cp.decode_step_s(1, 100) == pytest.approx(0.012)
    # No points: the fit as it is.
    assert Profile.from_cost_profile(cost_profile(), kv_blocks=10).shape(4) == 1.0


def test_the_advisor_routes_each_request_by_its_id_as_the_gateway_does(monkeypatch):
    seen = []
    real = search.Router.route

    def spy(self, views, req, request_id=None, *, now=None):
        seen.append((request_id, now))
        return real(self, views, req, request_id, now=now)
    monkeypatch.setattr(search.Router, "route", spy)
    prof = dataclasses.replace(HOST, block_size=16, kv_blocks=1000)
    reqs = [SimRequest(i, 0.5 * i, 100, 3, [i]) for i in range(3)]
    plan = search.Plan("smollm2-cpu", prof, search.Slo(5.0, 1.0), 256)
    search.evaluate(search.Deployment(1, 1, False), reqs, plan)
    # Each with its id, stamped with its arrival: the conductor's in-flight entry per
    # request, dropped when a heartbeat acknowledges it, and its TTFT correction.
    assert seen == [("0", 0.0), ("1", 0.5), ("2", 1.0)]


def test_calibration_compares_one_engine_alone_with_the_steps_the_simulator_runs():
    # The engine measured 20 % over the fit at B = 4 when the profile was made; alone on
    # the host now it takes 1.3 x that measured step: the host factor is 1.3, not 1.56.
    cp = cost_profile(fit={"decode": [[4, 100, 1.2 * 0.015, 0.0]]})
    step = 1.3 * 1.2 * cp.decode_step_s(4, 400)
    assert alone_ratio(cp, (4, 100), True, step) == pytest.approx(1.3)
    assert alone_ratio(cp, (128, 0), False, 2 * cp.prefill_s(128, 0)) == pytest.approx(2.0)


def test_decode_and_prefill_steps_take_their_own_host_factors():
    """A busy neighbour slows a decode step (memory-bound) and a prefill (compute-bound)
    unequally; measured apart, the simulator runs each kind by its own factors."""
    prof = dataclasses.replace(HOST, prefill_contention=(1.0, 1.2, 1.4),
                               decode_contention=(1.0, 1.8, 2.6))
    assert [prof.contended(2, kind) for kind in ("", "prefill", "decode")] == [1.5, 1.2, 1.8]

    r0, r1 = _two_decode_workers(prof)
    assert r0.ttft == pytest.approx(1.6) and r1.ttft == pytest.approx(1.6 * 1.2)
    # decode-0's steps beside decode-1's prefill and its own serving share (as in
    # test_shared_host_slows_work_by_the_processes_busy_when_it_starts): decode factors.
    f0 = 1.8 + 0.02 / 0.041 * (2.6 - 1.8)
    assert r0.tbt == pytest.approx(0.021 * f0 + 0.02 + 1e-5 * f0 / 2)


def _two_decode_workers(prof):
    """Two 1,000-token requests at t=0, each prefilled and decoded on its own decode
    worker of one shared host: (r0, r1) after the run."""
    def route(views, req):
        return Decision({v.worker_id: v for v in views}[f"decode-{req.rid}"], None, "fixed")
    r0, r1 = [SimRequest(i, 0.0, 1000, 3, [10 * i, 10 * i + 1]) for i in range(2)]
    Simulator(prof, route, prefill=0, decode=2, shared_host=True).run([r0, r1])
    return r0, r1


def test_a_neighbour_counts_by_what_it_runs():
    """Live, a decode step beside a long prompt's prefill ran as if alone, beside another
    decode at the two-busy factor: each busy neighbour adds its weight to the count."""
    prof = dataclasses.replace(
        HOST, prefill_contention=(1.0, 1.2, 1.4), decode_contention=(1.0, 1.8, 2.6),
        neighbour_weights=(("decode", "long prefill", 0.0), ("prefill", "long prefill", 0.5)))
    assert prof.weight("decode", "long prefill") == 0.0
    assert prof.weight("decode", "decode") == 1.0  # not given: a whole busy process

    r0, r1 = _two_decode_workers(prof)
    # decode-1's prefill starts beside decode-0's 1000-token one: half a busy process.
    assert r0.ttft == pytest.approx(1.6) and r1.ttft == pytest.approx(1.6 * 1.1)
    # decode-0's steps beside decode-1's prefill count it as nothing: only the serving
    # share is added (x1.8 with the neighbour counted whole, as before).
    f0 = 1.0 + 0.02 / 0.041 * (1.8 - 1.0)
    assert r0.tbt == pytest.approx(0.021 * f0 + 0.02 + 1e-5 * f0 / 2)


def test_neighbour_weights_come_from_the_host_fit():
    host = {"decode_contention": [1.4, 1.7], "prefill_contention": [1.1, 1.3],
            "neighbour_weights": {"decode": {"long prefill": 0.0, "short prefill": 0.5,
                                             "bogus": 0.3, "decode": 1.5},
                                  "prefill": {"decode": True}, "other": {"decode": 0.1}}}
    prof = Profile.from_cost_profile(cost_profile(contention=[1.2, 1.5], fit={"host": host}),
                                     kv_blocks=10)
    # Unknown kinds and classes, weights outside [0, 1] and booleans are left out.
    assert prof.neighbour_weights == (("decode", "long prefill", 0.0),
                                      ("decode", "short prefill", 0.5))
    assert prof.contended(1 + prof.weight("decode", "short prefill"), "decode") == \
        pytest.approx(1.55)


def test_per_kind_factors_come_from_the_calibrations_host_fit():
    host = {"decode_contention": [1.6, 1.75, 3.0], "prefill_contention": [1.3, 1.4, 2.2]}
    cp = cost_profile(contention=[1.43, 1.52, 2.63], fit={"host": host})
    prof = Profile.from_cost_profile(cp, kv_blocks=10)
    assert (prof.decode_contention, prof.prefill_contention) == \
        ((1.6, 1.75, 3.0), (1.3, 1.4, 2.2))
    assert (prof.contended(2), prof.contended(2, "decode")) == (1.52, 1.75)
    # Absent, or not factors >= 1 that do not fall: the median factors serve both.
    for bad in ({}, {"decode_contention": [1.5, 1.2]}, {"decode_contention": [0.5]},
                {"decode_contention": "1.5"}):
        p = Profile.from_cost_profile(cost_profile(contention=[1.43, 1.52], fit={"host": bad}),
                                      kv_blocks=10)
        assert p.decode_contention == () and p.contended(2, "decode") == 1.52
    # calibrate_host chains a kind's ratios as it does the median ones.
    assert chained([1.4, 1.25, 1.5]) == pytest.approx([1.4, 1.75, 2.1])
    assert chained([0.9, 0.95, 1.3]) == pytest.approx([1.0, 1.0, 1.3])


def test_in_1p1d_decode_steps_beside_a_remote_prefill_take_the_two_busy_factor():
    # a decodes alone on decode-0; b's Prefill is reserved at a's next step boundary
    # and computes on prefill-0 (1.6 s x 2.0), its KV landing 1 s later; a's steps in
    # between run at the two-busy factor, before and after at the one-busy one.
    prof = dataclasses.replace(HOST, contention=(1.0, 2.0), token_overhead_s=0.0)
    a, b = SimRequest(0, 0.0, 1000, 301, [0, 1]), SimRequest(1, 2.0, 1000, 2, [2, 3])

    def route(views, req):
        by_id = {v.worker_id: v for v in views}
        return Decision(by_id["decode-0"], by_id["prefill-0"] if req.rid else None, "x")
    steps: list = []
    Simulator(prof, route, prefill=1, decode=1, shared_host=True, steps=steps).run([a, b])
    runs = [(s.batch, s.seconds / prof.decode_step_s(s.batch, s.context))
            for w, kind, s in steps if kind == "decode"]
    assert [n for n, _ in runs[:3]] == [1, 1, 2]
    assert [round(f, 3) for _, f in runs[:3]] == [1.0, 2.0, 1.0]
    assert b.ttft == pytest.approx(2.00071 + 3.2 + 1.0 - 2.0, abs=1e-4)


def test_calibrate_host_chains_each_kind_from_plain_medians():
    points = [((1, 64), True), ((8, 64), True), ((4, 256), True), ((512, 0), False),
              ((1024, 0), False)]
    alone = kind_medians([1.4, 1.6, 1.5, 1.1, 1.3], points)
    assert alone == pytest.approx({"decode": 1.5, "prefill": 1.2})
    busy = kind_medians([1.2, 1.0, 1.1, 2.0, 1.0], points)
    for kind in ("decode", "prefill"):  # floats all the way: chained takes them
        assert chained([alone[kind], busy[kind]]) == pytest.approx(
            {"decode": [1.5, 1.65], "prefill": [1.2, 1.8]}[kind])
