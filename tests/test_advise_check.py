"""bench/advise_check.py's offline half: the very requests bench/serve.py sends become
the simulator's, and the advisor's prediction ranks the two deployments."""

from __future__ import annotations

from bench import advise_check as ac
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
