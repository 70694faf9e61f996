"""bench/advise_check.py's offline half: the very requests bench/serve.py sends become
the simulator's, and the advisor's prediction ranks the two deployments."""

from __future__ import annotations

import dataclasses

import pytest

from bench import advise_check as ac
from bench import advise_runs
from bench.datasets import RequestSpec


def test_specs_become_simulated_requests_block_for_block():
    specs = [RequestSpec(tuple(range(40)), 5, 0.0), RequestSpec(tuple(range(15)), 1, 2.5)]
    reqs = ac.sim_requests(specs, 16)
    assert [(r.rid, r.arrival, r.prompt, r.output) for r in reqs] == \
        [(0, 0.0, 40, 5), (1, 2.5, 15, 1)]
    assert reqs[0].hashes == [1 << 32, 1 << 32 | 1] and reqs[1].hashes == []


def test_prediction_and_ranking_on_the_decode_heavy_load():
    specs = ac.specs_for("decode-heavy", 12, seed=3)
    assert len(specs) == 12 and all(40 <= s.prompt_len <= 80 for s in specs)
    pred = ac.predict(specs, ac.plan_for("decode-heavy"))
    assert set(pred) == {"colocated x2", "1P+1D"}
    for side in pred.values():
        assert side["completed"] == 12 and 0 <= side["good"] <= 12
    # One decode worker holds every batch in 1P+1D: its TPOT is the higher.
    assert pred["1P+1D"]["mean_tpot_ms"] > pred["colocated x2"]["mean_tpot_ms"]
    order = ac.ranking(pred)
    assert sorted(order) == sorted(pred)
    best, other = order
    assert pred[best]["goodput"] >= pred[other]["goodput"]


def test_predicted_routing_carries_each_decision_and_its_reason():
    specs = ac.specs_for("prefill-heavy", 8, seed=0)
    pred = ac.predict(specs, ac.plan_for("prefill-heavy"))
    colo, split = pred["colocated x2"]["routing"], pred["1P+1D"]["routing"]
    assert len(colo) == len(split) == 8
    assert all(not remote and reason.startswith("no prefill worker")
               for remote, _, reason in colo)
    # The first prompt finds both workers idle: prefilled where it decodes, the local
    # estimate no later than the remote one (no transfer).
    assert split[0][0] is False and split[0][2].startswith("local ")
    for (remote, fell_back, reason), req in zip(split, pred["1P+1D"]["requests"], strict=True):
        assert req[5] == (not remote or fell_back)  # prefilled on its decode worker
        assert "prefill on " + ("prefill-0" if remote else "decode-0") in reason


def test_live_routing_is_read_from_the_conductors_log(tmp_path):
    log = tmp_path / "conductor.log"
    log.write_text(
        "2026-12-02T05:59:40.1Z [info     ] conductor started   control=tcp://x\n"
        "2026-12-02T05:59:41.8Z [info     ] routed                         decode=decode-1 "
        "prefill=None reason='local 3.255s <= remote 3.297s; prefill on decode-1 hit 0/56 "
        "blocks' request_id=cmpl-fb2f service=conductor\n"
        "2026-12-02T05:59:45.3Z [info     ] routed                         decode=decode-1 "
        "prefill=prefill-0 reason='local prefill would stall 1 decodes 6.173s' "
        "request_id=cmpl-0248 service=conductor\n"
        "2026-12-02T05:59:46.0Z [info     ] rejected   reason='predicted TTFT' request_id=x\n")
    assert advise_runs.routes_logged(log) == [
        [False, "local 3.255s <= remote 3.297s; prefill on decode-1 hit 0/56 blocks"],
        [True, "local prefill would stall 1 decodes 6.173s"]]
    assert advise_runs.routes_logged(tmp_path / "missing.log") == []


def test_live_step_trace_is_read_per_worker_and_kind(tmp_path):
    from bench import sim_steps
    (tmp_path / "1P+1D-decode-1.log").write_text(
        "2026-12-02T09:17:14Z [debug    ] step     chunks=1 decode=0 ms=3000.0 prefill=1000\n"
        "2026-12-02T09:17:15Z [debug    ] step     chunks=0 decode=1 ms=50.0 prefill=0\n"
        "2026-12-02T09:17:15Z [debug    ] step     chunks=0 decode=1 ms=70.0 prefill=0\n"
        "2026-12-02T09:17:16Z [debug    ] step     chunks=0 decode=5 ms=150.0 prefill=0\n"
        "2026-12-02T09:17:17Z [debug    ] step     chunks=1 decode=5 ms=2100.0 prefill=700\n"
        "2026-12-02T09:17:18Z [info     ] routed   decode=decode-1 prefill=None\n")
    (tmp_path / "1P+1D-prefill-0.log").write_text(
        "2026-12-02T09:17:14Z [debug    ] step     chunks=2 decode=0 ms=4000.0 prefill=2000\n")
    (tmp_path / "colocated_x2-unified-0.log").write_text(
        "2026-12-02T09:17:14Z [debug    ] step     chunks=0 decode=1 ms=9.0 prefill=0\n")
    (tmp_path / "prefill-heavy-1P+1D-prefill-0.log").write_text(
        "2026-12-02T09:17:14Z [debug    ] step     chunks=1 decode=0 ms=500.0 prefill=100\n")
    # A workload's own logs where it has them (advise_check names them so), else all.
    assert sim_steps.live(tmp_path, "1P+1D", "prefill-heavy") == {
        ("prefill worker", "prefill ms/token"): [5.0]}
    assert ac.log_name("prefill-heavy", "colocated x2", "gateway.log") == \
        "prefill-heavy-colocated_x2-gateway.log"
    got = sim_steps.live(tmp_path, "1P+1D", "decode-heavy")
    assert got == {("decode worker", "prefill ms/token"): [3.0, 3.0],
                   ("decode worker", "decode B=1 ms"): [50.0, 70.0],
                   ("decode worker", "decode B=4-7 ms"): [150.0],
                   ("prefill worker", "prefill ms/token"): [2.0]}
    # The simulator's side of the same deployment reports both kinds of steps.
    sim = sim_steps.simulated("prefill-heavy", "1P+1D", 8, 0)
    assert ("prefill worker", "prefill ms/token") in sim
    assert any(kind.startswith("decode B=") for _, kind in sim)


def test_decode_step_is_charged_as_the_simulator_charges_it():
    prof = ac.plan_for("decode-heavy").profile
    # The measured shape and the host's decode factor (not the three-term fit and the
    # profile's overall factor), plus the serving overhead per sequence.
    step = prof.decode_step_s(4, 600) * prof.contended(2, "decode") + 4 * prof.token_overhead_s
    assert prof.served_decode_step_s(4, 600, 2) == step
    assert prof.contended(2, "decode") > prof.contended(2)  # this profile's decode factor
    assert prof.served_decode_step_s(0, 600, 2) == 0.0
    # A mean batch between two whole ones costs between their steps.
    assert prof.served_decode_step_s(3, 450, 2) < prof.served_decode_step_s(3.5, 525, 2) \
        < prof.served_decode_step_s(4, 600, 2)


def test_expected_tpot_is_a_fixed_point_over_the_runs_horizon():
    prof = ac.plan_for("decode-heavy").profile
    inp, out, rate, _, _ = ac.WORKLOADS["decode-heavy"]
    tpot, batch = ac.expected_tpot(prof, inp, out, rate, 24)
    prefill = prof.prefill_s(inp, 0) * prof.contended(ac.WORKERS, "prefill")
    rho = rate / ac.WORKERS * prefill
    assert tpot == pytest.approx(
        prof.served_decode_step_s(batch, batch * (inp + out / 2), ac.WORKERS) / (1 - rho),
        rel=1e-6)
    stay = prefill + (out - 1) * tpot
    span = 24 / rate
    assert batch == pytest.approx(24 / ac.WORKERS * stay / (span + stay), rel=1e-6)
    assert 2.5 < batch < 4  # more than the 2.2 the step at batch 2 would give
    # A longer run nears the steady state: a larger batch, a slower step.
    assert ac.expected_tpot(prof, inp, out, rate, 240)[1] > batch + 1


def test_decode_heavy_slo_clears_the_spread_a_tpot_at_the_mean_would_cut():
    specs = ac.specs_for("decode-heavy", 24, seed=0)
    plan = ac.plan_for("decode-heavy", requests=24)
    prof = plan.profile
    inp, out, rate, _, tpot_x = ac.WORKLOADS["decode-heavy"]
    expected = ac.expected_tpot(prof, inp, out, rate, 24)[0]
    assert tpot_x == 1.5 and plan.slo.tpot_s == pytest.approx(1.5 * expected)
    pred = ac.predict(specs, plan)
    assert ac.ranking(pred)[0] == "colocated x2"
    tpots = [r[4] for r in pred["colocated x2"]["requests"]]
    # At the expected TPOT itself the SLO would cut through the requests' spread (a
    # few percent of step speed decides each one); at 1.5 x it clears them all.
    assert min(tpots) < expected * 1e3 < max(tpots)
    assert max(tpots) < plan.slo.tpot_s * 1e3
    assert pred["colocated x2"]["good"] == 24


def test_host_factors_refit_from_a_runs_step_traces(tmp_path):
    from datetime import UTC, datetime

    from common.cost_profile import load_profile
    from services.sim.profiles import Profile

    prof = ac.plan_for("decode-heavy").profile
    inp, out = ac.WORKLOADS["decode-heavy"][:2]
    step = prof.decode_step_s(3, 3 * (inp + out / 2)) * prof.contended(1, "decode")
    lines, t = [], 1_800_000_000.0
    for _ in range(26):  # one worker alone, at 1.25 x the charge; the first a warm-up
        t += step * 1.25
        stamp = datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        lines.append(f"{stamp} [debug    ] step     chunks=0 decode=3 "
                     f"ms={step * 1.25e3:.3f} prefill=0")
    (tmp_path / "decode-heavy-colocated_x2-unified-0.log").write_text("\n".join(lines))
    (tmp_path / "decode-heavy-colocated_x2-gateway.log").write_text(lines[0])
    got = ac.refit_from_logs([tmp_path], ac.PROFILE, tmp_path / "refit.json")
    # One context only: no context term; the factor the steps ran at, 1.25 x the charge.
    assert got["context_term"] is None and "decode_per_ctx_token_s" not in got
    assert got["factors"] == {"decode x1": [25, pytest.approx(
        prof.decode_contention[0] * 1.25, rel=1e-3)]}
    new = Profile.from_cost_profile(load_profile(str(tmp_path / "refit.json")), kv_blocks=1)
    assert new.name == "refit"
    assert new.decode_contention[0] == pytest.approx(prof.decode_contention[0] * 1.25,
                                                     abs=1e-3)
    assert new.prefill_contention == prof.prefill_contention
    assert new.cost == prof.cost


def test_the_seed_draws_another_workload():
    a, b = ac.specs_for("prefill-heavy", 48, seed=0), ac.specs_for("prefill-heavy", 48, seed=1)
    assert len(a) == len(b) == ac.REQUESTS
    assert [s.prompt_len for s in a] != [s.prompt_len for s in b]
    assert [s.arrival_s for s in a] != [s.arrival_s for s in b]
    assert [s.prompt_len for s in a] == [s.prompt_len for s in ac.specs_for(
        "prefill-heavy", 48, seed=0)]


def test_repeated_live_runs_alternate_and_keep_the_median_run(monkeypatch, tmp_path):
    calls = []
    goodputs = {"colocated x2": [0.30, 0.10, 0.20], "1P+1D": [0.05, 0.04, 0.06]}

    def fake_live(specs, plan, dep, logs, step_trace, workload):
        label = next(k for k, d in ac.DEPLOYMENTS.items() if d == dep)
        k = sum(1 for c, _ in calls if c == label)
        calls.append((label, logs))
        # Run k's one request took 1 s to its first token and was good within 1.25x.
        return {"goodput": goodputs[label][k], "routing": [], "run": k, "duration_s": 2.0,
                "requests": [[0.0, 8, 1, 1000.0 * (1 + k / 8), None]]}

    monkeypatch.setattr(ac, "live", fake_live)
    plan = dataclasses.replace(ac.plan_for("prefill-heavy"), slo=ac.Slo(1.0, 0.1))
    out = ac.live_repeated([], plan, ac.DEPLOYMENTS, 3, tmp_path, False, "prefill-heavy")
    # A B, B A, A B: a drift in the machine's load falls on both deployments.
    assert [c for c, _ in calls] == ["colocated x2", "1P+1D", "1P+1D", "colocated x2",
                                     "colocated x2", "1P+1D"]
    assert [logs.name for _, logs in calls] == ["r0", "r0", "r1", "r1", "r2", "r2"]
    colo, split = out["colocated x2"], out["1P+1D"]
    assert colo["goodput"] == 0.20 and colo["run"] == 2 and colo["requests"][0][3] == 1250
    # Per SLO scale, the median run: TTFTs 1000, 1125, 1250 ms against 1000 ms scaled.
    assert colo["sweep"] == [0.0, 0.5, 0.5, 0.5]
    assert colo["goodput_range"] == [0.10, 0.30]
    assert [r["goodput"] for r in colo["runs"]] == [0.30, 0.10, 0.20]
    assert [r["requests"][0][3] for r in colo["runs"]] == [1000, 1125, 1250]
    assert all("routing" not in r for r in colo["runs"])
    assert split["goodput"] == 0.05 and split["goodput_range"] == [0.04, 0.06]


def test_noisy_prediction_keeps_the_median_run_and_the_spread():
    specs = ac.specs_for("prefill-heavy", 12, seed=0)
    plan = dataclasses.replace(ac.plan_for("prefill-heavy"), noise=0.1)
    pred = ac.predict(specs, plan, {"1P+1D": ac.DEPLOYMENTS["1P+1D"]}, runs=5)["1P+1D"]
    assert len(pred["runs"]) == 5 and pred["runs"] == sorted(pred["runs"])
    assert pred["goodput"] == pred["runs"][2]
    assert pred["goodput_range"] == [pred["runs"][0], pred["runs"][-1]]
    # Each run is its own draw: seed k is the plan's seed + k, as one run alone gives.
    one = ac.predict(specs, dataclasses.replace(plan, seed=3),
                     {"1P+1D": ac.DEPLOYMENTS["1P+1D"]})["1P+1D"]
    assert one["goodput"] in pred["runs"]
    assert len(pred["requests"]) == 12 and pred["completed"] == 12


def test_goodput_swept_over_slo_scales_counts_as_the_run_does():
    slo = ac.Slo(1.0, 0.1)
    row = {"duration_s": 10.0, "requests": [
        [0.0, 10, 5, 900.0, 90.0],      # good at every scale
        [1.0, 10, 5, 1100.0, 90.0],     # TTFT over 1.0 s, within 1.25 s
        [2.0, 10, 5, 500.0, 140.0],     # TPOT over 125 ms, within 150 ms
        [3.0, 10, 1, 1900.0, None],     # one token: no TPOT to miss; TTFT within 2 s
        [4.0, 10, 5, None, None]]}      # failed: never good
    assert advise_runs.sweep(row, slo) == [0.1, 0.2, 0.3, 0.4]
    # At scale 1 a simulated run's sweep is its goodput, exactly.
    specs = ac.specs_for("prefill-heavy", 12, seed=0)
    plan = ac.plan_for("prefill-heavy")
    pred = ac.predict(specs, plan, {"1P+1D": ac.DEPLOYMENTS["1P+1D"]})["1P+1D"]
    assert pred["sweep"][0] == pytest.approx(pred["goodput"])
    assert pred["sweep"] == sorted(pred["sweep"])  # looser SLOs: never fewer good
