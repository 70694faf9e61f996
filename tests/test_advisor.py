"""``pdserve advise``: the deployments it searches, how it scores and ranks them, the
config it writes (loaded by the processes' own settings loaders), and the command end to
end on a tiny trace."""

from __future__ import annotations

import dataclasses
import json
import math
import sys

import pytest

from common.config import load_settings
from common.cost_profile import load_profile
from services.advisor import config, report, search, workload
from services.advisor.report import Progress
from services.cache_pool.settings import PoolSettings
from services.cli import main
from services.conductor.server import ConductorSettings
from services.gateway.server import GatewaySettings
from services.sim.profiles import Profile
from services.worker.settings import WorkerSettings

CP = load_profile("smollm2-cpu")


def plan(ttft_s=5.0, tpot_s=0.2, **kw) -> search.Plan:
    return search.Plan("smollm2-cpu", Profile.from_cost_profile(CP, kv_blocks=1000),
                       search.Slo(ttft_s, tpot_s), 256, **kw)


def test_deployments_are_colocated_and_every_split_with_and_without_the_pool():
    names = [d.name for d in search.deployments(3, pool=True)]
    assert names == ["colocated x3", "colocated x3 +pool", "1P+2D", "1P+2D +pool",
                     "2P+1D", "2P+1D +pool"]
    assert [d.name for d in search.deployments(1, pool=False)] == ["colocated x1"]
    with pytest.raises(ValueError, match="at least 1 worker"):
        search.deployments(0, pool=False)


def test_one_request_scores_exactly_its_simulated_times():
    """An idle cluster: the prompt prefills where it decodes (no transfer is quicker),
    TTFT is the profile's prefill time and TPOT its one-sequence decode step."""
    load = workload.synthetic(requests=1, rate=1.0, input_len=100, output_len=5,
                              range_ratio=0.0)
    (r,) = load.base
    prefill = CP.prefill_s(100, 0)
    outcomes = search.search(search.deployments(2, pool=False), load.requests,
                             plan(ttft_s=prefill + 1e-9))
    assert [o.deployment.name for o in outcomes] == ["colocated x2", "1P+1D"]  # tie: simpler
    for o in outcomes:
        assert (o.good, o.completed, o.local_prefills) == (1, 1, 1)
        assert o.ttft_s["p50"] == pytest.approx(prefill, rel=1e-9)
        # Four steps over a context of 100, 101, 102, 103 tokens, at what the calibration
        # measured for one sequence against the fit (the simulator runs the measured).
        step = (CP.decode_step_s(1, 100) + CP.decode_per_ctx_token_s * 1.5) * \
            Profile.from_cost_profile(CP, kv_blocks=1).shape(1)
        assert o.tpot_s["p50"] == pytest.approx(step, rel=1e-9)
        assert o.goodput_rps == pytest.approx(1 / (prefill + 4 * o.tpot_s["p50"]), rel=1e-6)
    # A TTFT SLO just under the prefill time: nothing is good anywhere.
    missed = search.search(search.deployments(2, pool=False), load.requests,
                           plan(ttft_s=prefill * 0.999))
    assert [(o.good, o.goodput_rps) for o in missed] == [(0, 0.0), (0, 0.0)]


def test_ranking_is_by_goodput_then_ttft_and_counts_only_requests_within_both_slos():
    load = workload.synthetic(requests=40, rate=0.5, input_len=1024, output_len=100, seed=1)
    slo = plan(ttft_s=8.0, tpot_s=0.12)
    outcomes = search.search(search.deployments(3, pool=False), load.requests, slo)
    goodputs = [o.goodput_rps for o in outcomes]
    assert goodputs == sorted(goodputs, reverse=True) and goodputs[0] > goodputs[-1]
    for o in outcomes:  # re-score a fresh run of the same deployment by hand
        reqs = load.requests()
        again = search.evaluate(o.deployment, reqs, slo)
        good = [r for r in reqs if r.done is not None and r.ttft <= 8.0 and r.tbt <= 0.12]
        assert again.good == o.good == len(good) and 0 < o.good < 40
        span = max(r.done for r in reqs) - reqs[0].arrival
        assert o.goodput_rps == pytest.approx(len(good) / span)


def test_a_shared_prefix_is_found_in_the_caches():
    load = workload.synthetic(requests=30, rate=0.5, input_len=600, output_len=8,
                              shared_prefix=512, range_ratio=0.1)
    assert all(r.hashes[:32] == list(range(32)) for r in load.base)
    (o,) = search.search([search.Deployment(0, 1, False)], load.requests, plan())
    # Every request after the first reuses the 512 shared tokens on the one worker.
    assert o.cached_frac == pytest.approx(29 * 512 / sum(r.prompt for r in load.base))


def _load_all(path, roles):
    argv, env = ["--config", str(path)], {}
    out = {"conductor": load_settings(ConductorSettings, "conductor", argv, env),
           "gateway": load_settings(GatewaySettings, "gateway", argv, env)}
    for role in roles:
        out[role] = load_settings(WorkerSettings, role, argv + ["--role", role], env)
    if "[cache_pool]" in path.read_text():
        out["cache_pool"] = load_settings(PoolSettings, "cache_pool", argv, env)
    return out


@pytest.mark.parametrize("dep,admission", [(search.Deployment(0, 3, False), False),
                                           (search.Deployment(2, 1, True), True)])
def test_the_written_config_loads_and_routes_as_simulated(tmp_path, dep, admission):
    p = plan(ttft_s=2.5, tpot_s=0.15, admission=admission, pool_mib=64)
    path = config.write(tmp_path / "x" / "best.toml", config.render(dep, p, workload="w"))
    import tomllib
    tables = set(tomllib.loads(path.read_text()))
    roles = ["unified"] if dep.colocated else ["prefill", "decode"]
    assert tables == {"conductor", "gateway", *roles} | ({"cache_pool"} if dep.pool else set())
    loaded = _load_all(path, roles)
    cond = loaded["conductor"]
    assert cond.router_config() == p.conductor_settings(dep).router_config()
    assert (cond.policy, cond.cost_profile, cond.admission) == ("cache_aware", "smollm2-cpu",
                                                                admission)
    if admission:
        assert (cond.slo_ttft_ms, cond.slo_tbt_ms) == (2500.0, 150.0)
    else:
        assert math.isinf(cond.router_config().slo_ttft_s)
    for role in roles:
        w = loaded[role]
        assert (w.role, w.kv_cache_mib, w.control_addr, w.kv_port) == \
            (role, 256, "tcp://127.0.0.1:0", 0)
        assert w.cache_pools == (config.POOL if dep.pool else "")
    if dep.pool:
        assert loaded["cache_pool"].dram_mib == 64 and cond.cache_pools == config.POOL
    assert f"# pdserve advise: {dep.name}" in path.read_text()


def _trace(path, n=24):
    rows = [{"timestamp": int(i * 700), "input_length": 700 + 37 * (i % 5),
             "output_length": 4 + i % 3,
             "hash_ids": [i % 3, 100 + i] if i % 2 else [50 + i, 200 + i]} for i in range(n)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_the_command_end_to_end_on_a_tiny_trace(tmp_path, capsys):
    out = tmp_path / "adv"
    rc = main(["advise", "--workers", "2", "--slo-ttft-ms", "4000", "--slo-tpot-ms", "300",
               "--trace", str(_trace(tmp_path / "t.jsonl")), "--kv-cache-mib", "64",
               "--out", str(out), "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0, text
    result = json.loads((out / "advise.json").read_text())
    names = [o["name"] for o in result["outcomes"]]
    assert sorted(names) == sorted(["colocated x2", "colocated x2 +pool", "1P+1D",
                                    "1P+1D +pool"])
    assert result["stats"]["requests"] == 24
    assert f"recommended: {names[0]} -> {out / 'recommended.toml'}" in text
    lines = text.splitlines()
    table = lines[lines.index(next(x for x in lines if x.startswith("rank"))) + 1:][:4]
    assert [x[6:26].strip() for x in table] == names  # the deployment column, ranked
    assert (out / "recommended.toml").read_text().startswith(f"# pdserve advise: {names[0]}")
    pytest.importorskip("matplotlib")
    assert (out / "goodput.png").read_bytes()[:4] == b"\x89PNG"


def test_the_command_refuses_a_missing_workload_and_a_bad_trace(tmp_path, capsys):
    base = ["advise", "--workers", "2", "--slo-ttft-ms", "1", "--slo-tpot-ms", "1",
            "--out", str(tmp_path / "o")]
    assert main(base + ["--rate", "1"]) == 2
    assert "give --trace, or --rate, --input-len and --output-len" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text('{"timestamp": 0}\n')
    assert main(base + ["--trace", str(tmp_path / "bad.jsonl")]) == 2
    assert "cannot read trace" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_progress_without_tqdm_counts_on_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    bar = Progress(2, out=sys.stdout)
    for dep in search.deployments(2, pool=False):
        bar(dep)
    bar.close()
    assert capsys.readouterr().out.endswith("2/2 1P+1D               \n")


def test_noisy_runs_rank_each_deployment_by_its_median_run():
    load = workload.synthetic(requests=30, rate=0.5, input_len=1024, output_len=40, seed=2)
    noisy = dataclasses.replace(plan(ttft_s=6.0, tpot_s=0.12), noise=0.1, seed=5)
    outcomes = search.search(search.deployments(2, pool=False), load.requests, noisy,
                             runs=3)
    for o in outcomes:
        assert len(o.goodput_runs) == 3 and list(o.goodput_runs) == sorted(o.goodput_runs)
        assert o.goodput_rps == o.goodput_runs[1]
        # Run k is seed + k: each draw is what one run with that seed gives.
        alone = sorted(search.evaluate(o.deployment, load.requests(),
                                       dataclasses.replace(noisy, seed=5 + k)).goodput_rps
                       for k in range(3))
        assert list(o.goodput_runs) == alone
    goodputs = [o.goodput_rps for o in outcomes]
    assert goodputs == sorted(goodputs, reverse=True)
    text = report.table(outcomes, noisy.slo)
    assert "median of 3 noisy runs" in text and "goodput range" in text
    with pytest.raises(ValueError, match="runs must be >= 1"):
        search.search(search.deployments(2, pool=False), load.requests, noisy, runs=0)
