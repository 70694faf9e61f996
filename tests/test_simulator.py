"""The discrete-event simulator: hand-checked timings on tiny traces, local-prefill
interference, per-stage rejection, determinism, and the real policy driven end to end."""

from __future__ import annotations

import json
import math
import random

import pytest

from bench.sim.profiles import LLAMA70B_H100X4, Profile
from bench.sim.simulator import SimRequest, Simulator, load_trace, percentile
from common.records import CostCoefficients
from services.conductor.cache_policy import CacheAwarePolicy, PolicyConfig, Rejection
from services.conductor.cost_model import CostModel
from services.conductor.policy import Decision
from services.conductor.prefix_index import PrefixIndex
from services.conductor.routing_policy import PolicyRequest

# prefill(n, c) = 0.1 + 1e-3 n + 1e-6 n (n/2 + c); step(B, K) = 0.01 + 1e-3 B + 1e-5 K;
# 1000 B of KV per token over 1 MB/s: 1 s per 1000-token prompt.
TINY = Profile(name="tiny", cost=CostCoefficients(0.1, 1e-3, 1e-6, 0.01, 1e-3, 1e-5),
               kv_bytes_per_token=1000, block_size=512, kv_blocks=100,
               link_bandwidth=1e6, pool_bandwidth=1e6)


def fixed(prefill: str | None, decode: str = "decode-0"):
    """A router that always answers the same pair."""
    def route(views, req):
        by_id = {v.worker_id: v for v in views}
        return Decision(by_id[decode], by_id[prefill] if prefill else None, "fixed")
    return route


def test_two_requests_one_worker_each_hand_checked():
    a = SimRequest(0, 0.0, 1000, 3, [0, 1])
    b = SimRequest(1, 0.5, 1000, 2, [0, 2])
    index, cost = PrefixIndex(), CostModel(TINY.cost)
    Simulator(TINY, fixed("prefill-0"), prefill=1, decode=1, index=index, cost=cost).run([a, b])
    # a: prefill 0.1 + 1.0 + 0.5 = 1.6 s, KV 1.0 s -> first token 2.6; two steps at K=1000
    # and 1001: 0.021 + 0.02101.
    assert a.ttft == pytest.approx(2.6)
    assert a.done == pytest.approx(2.64201)
    assert a.tbt == pytest.approx(0.021005)
    # b waits for a, then hits block 0 (512 cached): 0.1 + 0.488 + 488 * 756e-6 = 0.956928;
    # done at 2.556928, but the link is busy with a's KV until 2.6: lands at 3.6.
    assert b.cached == 512
    assert b.ttft == pytest.approx(3.1)
    assert b.done == pytest.approx(3.621)
    assert b.tbt == pytest.approx(0.021)
    assert index.match([0, 1]) == {"prefill-0": 2, "decode-0": 2}
    assert index.match([0, 2]) == {"prefill-0": 2, "decode-0": 2}
    assert cost.observations == (2, 2)


def test_local_prefill_is_one_step_with_the_running_batch():
    a = SimRequest(0, 0.0, 1000, 3, [0, 1])
    b = SimRequest(1, 1.61, 1000, 2, [0, 2])
    Simulator(TINY, fixed(None), prefill=0, decode=1).run([a, b])
    # a: local prefill 1.6 s, first step ends at 1.621; b arrives meanwhile. As the live
    # scheduler does, the next step holds a's decode and b's prefill (block 0 cached by
    # a: 0.956928 s) in one forward: a's decode step (B=1, K=1001) is added to it, and a
    # gets its last token at its end instead of waiting for a step of its own after it.
    mixed = 1.621 + 0.956928 + (0.01 + 0.001 + 0.01001)
    assert a.ttft == pytest.approx(1.6)
    assert b.ttft == pytest.approx(mixed - 1.61)
    assert a.done == pytest.approx(mixed)
    assert a.tbt == pytest.approx((mixed - 1.6) / 2)  # the prefill is in a's TBT
    # then b alone: one step of B=1, K=1000.
    assert b.done == pytest.approx(mixed + 0.021)


def test_local_prompts_that_fit_one_step_are_prefilled_together():
    # Three local prompts at once: the first two (2 x 1000 tokens) fit the step's 2048
    # and share its fixed cost (0.1 + 2 x 1.5 s); the third takes the next step, which
    # also decodes the first two (B=2, K=2000: 0.01 + 0.002 + 0.02).
    reqs = [SimRequest(i, 0.0, 1000, 3, [2 * i, 2 * i + 1]) for i in range(3)]
    Simulator(TINY, fixed(None), prefill=0, decode=1).run(reqs)
    assert reqs[0].ttft == pytest.approx(3.1) and reqs[1].ttft == pytest.approx(3.1)
    assert reqs[2].ttft == pytest.approx(3.1 + 1.6 + 0.032)


def test_decode_kv_capacity_queues_or_rejects_per_stage():
    # Each request needs ceil(1201 / 512) = 3 blocks, all a decode worker has.
    small = Profile(**{**{f: getattr(TINY, f) for f in Profile.__slots__}, "kv_blocks": 3})
    reqs = [SimRequest(i, 0.0, 1000, 201, [2 * i, 2 * i + 1]) for i in range(3)]
    Simulator(small, fixed("prefill-0"), prefill=1, decode=1).run(reqs)
    assert all(r.done is not None and not r.rejected for r in reqs)
    # As the live decode worker does, 1 and 2 find no blocks to reserve and queue to be
    # prefilled there (1.6 s each), each once the one before has finished decoding.
    assert reqs[0].ttft == pytest.approx(2.6) and reqs[0].prefill_id == "prefill-0"
    assert [(r.prefill_id, r.fell_back) for r in reqs[1:]] == [(None, True)] * 2
    assert reqs[1].first_token == pytest.approx(reqs[0].done + 1.6)
    assert reqs[2].first_token == pytest.approx(reqs[1].done + 1.6)
    reqs = [SimRequest(i, 0.0, 1000, 201, [2 * i, 2 * i + 1]) for i in range(3)]
    Simulator(small, fixed("prefill-0"), prefill=1, decode=1,
              stage_reject_wait_s=100.0).run(reqs)
    assert [r.rejected for r in reqs] == ["", "decode", "decode"]  # no blocks to reserve
    reqs = [SimRequest(i, 0.0, 1000, 2, [2 * i, 2 * i + 1]) for i in range(3)]
    Simulator(TINY, fixed("prefill-0"), prefill=1, decode=1,
              stage_reject_wait_s=2.0).run(reqs)
    assert [r.rejected for r in reqs] == ["", "", "prefill"]  # 1.6 s, then 3.2 s ahead


def synthetic_trace(path, n: int, seed: int) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        t, convs = 0.0, []
        for _ in range(n):
            t += rng.expovariate(4.0)
            if convs and rng.random() < 0.5:
                prefix = rng.choice(convs)
            else:
                prefix = [rng.randrange(10**9) for _ in range(rng.randint(1, 8))]
                convs.append(prefix)
            hashes = prefix + [rng.randrange(10**9) for _ in range(rng.randint(1, 4))]
            f.write(json.dumps({"timestamp": int(t * 1000), "input_length": 512 * len(hashes),
                                "output_length": rng.randint(1, 300), "hash_ids": hashes})
                    + "\n")


def run_ours(trace, admission=False):
    prof = LLAMA70B_H100X4
    index, cost = PrefixIndex(), CostModel(prof.cost)
    pol = CacheAwarePolicy(index, cost, PolicyConfig(prof.kv_bytes_per_token,
                                                     prof.link_bandwidth))
    decisions = []

    def route(views, req):
        d = pol.decide(views, PolicyRequest(
            prompt_tokens=req.prompt, block_hashes=req.hashes, block_size=prof.block_size,
            output_tokens=req.output, slo_ttft_s=2.0, slo_tbt_s=0.1, admission=admission))
        decisions.append(d.reason)
        return d
    reqs = load_trace(trace, speed=4.0)
    Simulator(prof, route, prefill=3, decode=2, index=index, cost=cost).run(reqs)
    return reqs, decisions


def test_deterministic_for_a_trace_and_policy(tmp_path):
    trace = tmp_path / "t.jsonl"
    synthetic_trace(trace, 300, seed=1)
    (r1, d1), (r2, d2) = run_ours(trace), run_ours(trace)
    assert d1 == d2
    assert [(r.prefill_id, r.decode_id, r.ttft, r.done) for r in r1] == \
        [(r.prefill_id, r.decode_id, r.ttft, r.done) for r in r2]
    assert all(r.done is not None for r in r1)
    assert any(r.cached > 0 for r in r1)  # the index drove cache hits
    assert all(reason for reason in d1)


def test_early_rejection_keeps_admitted_requests_within_the_slo(tmp_path):
    trace = tmp_path / "t.jsonl"
    synthetic_trace(trace, 300, seed=2)
    reqs, _ = run_ours(trace, admission=True)
    admitted = [r for r in reqs if not r.rejected]
    assert 0 < len(admitted) < len(reqs)
    assert {r.rejected for r in reqs} == {"", "arrival"}
    late = [r for r in admitted if r.ttft > 2.0]
    assert len(late) <= len(admitted) // 20  # predictions from stale heartbeats


def test_bad_input_is_an_explicit_error():
    with pytest.raises(ValueError, match="KV blocks"):
        Simulator(TINY, fixed("prefill-0"), prefill=1, decode=1).run(
            [SimRequest(0, 0.0, 100_000, 2, [0])])
    with pytest.raises(ValueError, match="speed"):
        load_trace("unused", speed=0)
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and math.isnan(percentile([], 99))
    assert isinstance(Rejection("x", 1.0), tuple)


def test_the_step_samples_the_workers_report_are_kept_for_a_step_trace():
    a = SimRequest(0, 0.0, 1000, 3, [0, 1])
    steps: list = []
    Simulator(TINY, fixed("prefill-0"), prefill=1, decode=1, steps=steps).run([a])
    # The prefill of 1000 tokens (1.6 s) on the prefill worker; then one run of two
    # decode steps at B = 1 from K = 1000 (0.021 and 0.02101 s), its mean.
    assert [(w, kind) for w, kind, _ in steps] == [("prefill-0", "prefill"),
                                                   ("decode-0", "decode")]
    (_, _, pre), (_, _, dec) = steps
    assert (pre.tokens, pre.cached, pre.seconds) == ([1000], [0], pytest.approx(1.6))
    assert (dec.batch, dec.context, dec.seconds) == (1, 1000, pytest.approx(0.021005))
