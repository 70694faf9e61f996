"""The simulator follows the live workers' rules, one tiny trace per rule: the prefix
cache is the worker's KV blocks, the pool a separate tier only when configured, the KV
lease and the fall-back to a local prefill, timings reach the cost model only after the
work ran (in heartbeats), and costs come from a profile file, with optional noise."""

from __future__ import annotations

import dataclasses
import statistics

import pytest

from bench.sim.profiles import Profile
from bench.sim.simulator import SimRequest, Simulator
from common.cost_profile import CostProfile, save_profile
from common.records import CostCoefficients
from services.conductor.cost_model import CostModel
from services.conductor.policy import Decision

# prefill(n, c) = 0.1 + 1e-3 n + 1e-6 n (n/2 + c): 1.6 s for a 1000-token prompt;
# 1000 B of KV per token over 1 MB/s: 1 s per 1000 tokens, on the link or from the pool.
COST = CostCoefficients(0.1, 1e-3, 1e-6, 0.01, 1e-3, 1e-5)
TINY = Profile(name="tiny", cost=COST, kv_bytes_per_token=1000, block_size=512,
               kv_blocks=100, link_bandwidth=1e6, pool_bandwidth=1e6)


def fixed(prefill: str | None, decode: str = "decode-0"):
    def route(views, req):
        by_id = {v.worker_id: v for v in views}
        return Decision(by_id[decode], by_id[prefill] if prefill else None, "fixed")
    return route


def four(kv_blocks: int = 100, **sim_kw) -> tuple[list[SimRequest], Simulator]:
    """A, B, C with distinct prompts, then D repeating A's, 10 s apart."""
    prof = dataclasses.replace(TINY, kv_blocks=kv_blocks)
    reqs = [SimRequest(i, 10.0 * i, 1000, 2, h)
            for i, h in enumerate([[0, 1], [2, 3], [4, 5], [0, 1]])]
    sim = Simulator(prof, fixed("prefill-0"), prefill=1, decode=1, **sim_kw)
    sim.run(reqs)
    return reqs, sim


def test_prefix_cache_is_the_workers_kv_blocks():
    reqs, sim = four(kv_blocks=100)
    assert reqs[3].cached == 999  # A's blocks still cached on prefill-0
    # With 4 blocks, B's and C's prompts evict A's freed blocks (oldest first).
    reqs, sim = four(kv_blocks=4)
    assert reqs[3].cached == 0
    assert reqs[3].ttft == pytest.approx(reqs[0].ttft) == pytest.approx(2.6)
    match = sim.index.match([4, 5])
    assert match == {"prefill-0": 2, "decode-0": 2}
    assert sim.index.match([2, 3]) == {}  # evicted everywhere, the index told
    for w in sim.workers.values():
        assert w.kv.used == 0 and len(w.kv.lru) <= 4


def test_pool_is_a_separate_tier_only_when_configured():
    reqs, sim = four(kv_blocks=4)
    assert not any(loc.startswith("pool:") for loc in sim.index.match([4, 5]))
    reqs, sim = four(kv_blocks=4, pool_blocks=8)
    assert sim.index.match([0, 1])["pool:dram"] == 2
    # D's blocks left prefill-0 but the pool kept them: fetched (2 blocks at 1 MB/s)
    # instead of computed: 1.024 s + prefill(1, 999) + the 1 s transfer.
    assert reqs[3].cached == 999
    assert reqs[3].ttft == pytest.approx(1.024 + 0.1 + 1e-3 + 1e-6 * (0.5 + 999) + 1.0)


def test_kv_lease_runs_out_and_the_decode_worker_prefills_itself():
    beats = []
    reqs = [SimRequest(0, 0.0, 1000, 3, [0, 1]), SimRequest(1, 0.0, 1000, 3, [2, 3])]
    sim = Simulator(TINY, fixed("prefill-0"), prefill=1, decode=1, kv_lease_s=2.0)
    real = sim.registry.heartbeat
    sim.registry.heartbeat = lambda hb, now=None: beats.append(hb) or real(hb, now=now)
    sim.run(reqs)
    # At 1 s both wait for their KV on decode-0 (blocks reserved), one on prefill-0.
    first = {hb.worker_id: hb for hb in beats if hb.seq == 1}
    assert (first["decode-0"].waiting_for_kv, first["decode-0"].waiting) == (2, 0)
    assert first["decode-0"].free_blocks == 100 - 2 * 2  # 1003 tokens each
    # A's KV would land at 2.6 and B's prefill end at 3.2: at 2.0 both leases run out,
    # and both prompts are prefilled on decode-0, in one step as they fit its token
    # budget (the fixed cost once: 0.1 + 2 x 1.5 s).
    assert [(r.routed_prefill, r.prefill_id, r.fell_back) for r in reqs] == \
        [("prefill-0", None, True)] * 2
    assert sorted(r.first_token for r in reqs) == pytest.approx([5.1, 5.1])
    assert sim.workers["decode-0"].fallbacks == 2
    pre = sim.workers["prefill-0"]
    assert pre.kv.used == 0 and not pre.queue and pre.current is None


def test_no_blocks_to_reserve_means_a_local_prefill():
    prof = dataclasses.replace(TINY, kv_blocks=3)
    reqs = [SimRequest(0, 0.0, 1000, 201, [0, 1]), SimRequest(1, 0.1, 1000, 201, [2, 3])]
    Simulator(prof, fixed("prefill-0"), prefill=1, decode=1).run(reqs)
    assert (reqs[0].prefill_id, reqs[1].prefill_id, reqs[1].fell_back) == \
        ("prefill-0", None, True)


def test_the_cost_model_sees_a_duration_only_after_the_work_ran():
    cost = CostModel(COST)
    seen = {}

    def route(views, req):
        seen[req.rid] = cost.observations
        by_id = {v.worker_id: v for v in views}
        return Decision(by_id["decode-0"], None, "local")
    # A local prefill runs 0 .. 1.6; heartbeats at 1, 2, 3 s.
    reqs = [SimRequest(0, 0.0, 1000, 2, [0, 1]), SimRequest(1, 0.5, 10, 2, [7]),
            SimRequest(2, 1.7, 10, 2, [8]), SimRequest(3, 2.1, 10, 2, [9])]
    Simulator(TINY, route, prefill=0, decode=1, cost=cost).run(reqs)
    assert seen[0] == (0, 0)
    assert seen[1] == (0, 0)  # in progress: its duration is unknown
    assert seen[2] == (0, 0)  # done at 1.6, but reported only in the 2 s heartbeat
    assert seen[3][0] == 3 and seen[3][1] >= 1  # all three prefills ended before 2 s


def test_costs_come_from_a_profile_file_with_optional_noise(tmp_path):
    cp = CostProfile("file", *(getattr(COST, k) for k in COST.__slots__),
                     kv_bytes_per_token=1000, block_size=16, link_bandwidth=1e6,
                     pool_bandwidth=1e6, kv_capacity_tokens=51_200)
    path = save_profile(cp, tmp_path / "file.json")
    prof = Profile.load(str(path), block_size=512)
    assert prof == dataclasses.replace(TINY, name="file")  # 51,200 tokens = 100 blocks
    with pytest.raises(ValueError, match="kv_blocks"):
        Profile.from_cost_profile(dataclasses.replace(cp, kv_capacity_tokens=0))

    def run(noise: float, seed: int = 0) -> list[float]:
        reqs = [SimRequest(i, 5.0 * i, 1000, 20, [2 * i, 2 * i + 1]) for i in range(40)]
        Simulator(prof, fixed(None), prefill=0, decode=1, noise=noise, seed=seed).run(reqs)
        return [r.ttft for r in reqs]
    exact = run(0.0)
    assert exact == pytest.approx([1.6] * 40)
    noisy = run(0.2)
    assert noisy == run(0.2) and noisy != run(0.2, seed=1)
    assert len(set(noisy)) == 40
    assert statistics.mean(noisy) == pytest.approx(1.6, rel=0.1)
    with pytest.raises(ValueError, match="noise"):
        Simulator(prof, fixed(None), prefill=0, decode=1, noise=-0.1)


def test_heartbeats_report_load_as_the_live_snapshot_does():
    """Taken between engine steps: a prompt counts whole (cached prefix included) and as
    waiting until its prefill step ends, on a prefill and on a decode worker."""
    beats = []
    # A (1000 tokens) prefilled remotely 0.0-1.6 s; B repeats A's first block, arrives
    # at 0.5 s and queues behind it; C (600 tokens) is prefilled on decode-0 at 3.0 s.
    reqs = [SimRequest(0, 0.0, 1000, 2, [0, 1]), SimRequest(1, 0.5, 1000, 2, [0, 9]),
            SimRequest(2, 3.0, 600, 2, [7, 8])]
    routes = iter([fixed("prefill-0"), fixed("prefill-0"), fixed(None)])
    sim = Simulator(TINY, lambda views, req: next(routes)(views, req), prefill=1,
                    decode=1, heartbeat_s=0.25)
    real = sim.registry.heartbeat
    sim.registry.heartbeat = lambda hb, now=None: beats.append((now, hb)) or real(hb, now=now)
    sim.run(reqs)
    pre = {round(t, 2): (hb.waiting, hb.queued_prefill_tokens)
           for t, hb in beats if hb.worker_id == "prefill-0"}
    # Nothing drains while A's step runs; B counts its cached 512 tokens too.
    assert pre[0.25] == (1, 1000) and pre[1.5] == (2, 2000)
    assert pre[1.75] == (1, 1000)  # A done at 1.6 s; B's step runs
    dec = {round(t, 2): (hb.waiting, hb.queued_prefill_tokens)
           for t, hb in beats if hb.worker_id == "decode-0"}
    # C prefills on decode-0 from 3.0 s to 3.88 s (0.1 + 0.6 + 0.18).
    assert dec[3.25] == (1, 600) and dec[3.75] == (1, 600) and dec[4.0] == (0, 0)


def test_a_remote_request_is_reserved_between_the_decode_workers_steps():
    """Live, the decode worker reserves a remote request's blocks, sends its Prefill and
    starts its lease on the engine thread, between steps: one arriving during a local
    prefill step waits for that step's end (decode_role.py, engine_loop.py)."""
    beats = []
    # A (1000 tokens) prefills on decode-0 from 0.0 to 1.6 s; B (routed to prefill-0)
    # arrives at 0.5 s: reserved at 1.6 s, prefilled 1.6-3.2 s, its KV across by 4.2 s.
    reqs = [SimRequest(0, 0.0, 1000, 2, [0, 1]), SimRequest(1, 0.5, 1000, 2, [2, 3])]
    routes = iter([fixed(None), fixed("prefill-0")])
    sim = Simulator(TINY, lambda views, req: next(routes)(views, req), prefill=1,
                    decode=1, heartbeat_s=0.25, kv_lease_s=2.65)
    real = sim.registry.heartbeat
    sim.registry.heartbeat = lambda hb, now=None: beats.append((now, hb)) or real(hb, now=now)
    sim.run(reqs)
    assert reqs[1].ttft == pytest.approx(4.2 - 0.5)
    assert not reqs[1].fell_back  # the lease (2.65 s) runs from 1.6 s, not from 0.5 s
    seen = {(round(t, 2), hb.worker_id): hb for t, hb in beats}
    # At 1.5 s B is neither waiting for KV on decode-0 nor acknowledged, nor queued on
    # prefill-0; at 1.75 s it is, and prefill-0 is prefilling it.
    d, p = seen[1.5, "decode-0"], seen[1.5, "prefill-0"]
    assert (d.waiting_for_kv, d.admitted, p.waiting) == (0, [], 0)
    d, p = seen[1.75, "decode-0"], seen[1.75, "prefill-0"]
    assert (d.waiting_for_kv, d.admitted, p.waiting, p.queued_prefill_tokens) == \
        (1, ["1"], 1, 1000)


def test_a_long_local_prompt_lets_a_reservation_in_between_its_chunks():
    """A prompt longer than one step's token budget prefills in chunks, one engine step
    each: a remote request arriving meanwhile is reserved at the end of the chunk in
    progress, not of the whole prompt."""
    # A: 5000 tokens on decode-0 from 0 s, chunks of 2048, 2048, 904 tokens; B (1000
    # tokens, routed to prefill-0) arrives at 1.0 s, in the first chunk.
    reqs = [SimRequest(0, 0.0, 5000, 2, list(range(9))), SimRequest(1, 1.0, 1000, 2, [20, 21])]
    routes = iter([fixed(None), fixed("prefill-0")])
    sim = Simulator(TINY, lambda views, req: next(routes)(views, req), prefill=1, decode=1)
    sim.run(reqs)
    parts = [0.1 + 2.048 + 1e-6 * 2048 * 1024, 0.1 + 2.048 + 1e-6 * 2048 * (1024 + 2048),
             0.1 + 0.904 + 1e-6 * 904 * (452 + 4096)]
    whole = 0.1 + 5.0 + 1e-6 * 5000 * 2500  # A's step: one fixed cost, as one prefill
    assert TINY.chunk_ends(5000, 0, 2048) == pytest.approx(
        [parts[0] / sum(parts), (parts[0] + parts[1]) / sum(parts)])
    cut = whole * parts[0] / sum(parts)  # 4.2 s
    assert reqs[0].ttft == pytest.approx(whole)
    assert reqs[1].ttft == pytest.approx(cut + 1.6 + 1.0 - 1.0)  # prefill, then the link


def test_per_stage_rejection_at_prefill_is_judged_when_the_prefill_arrives():
    # A prefills on decode-0 from 0.0 to 1.6 s; B, for prefill-0 through decode-0,
    # arrives at 0.5 s with prefill-0 idle but reaches it only at 1.6 s, when C (through
    # the idle decode-1, at 1.0 s) has 1.0 s of prefill left there: over the 0.5 s wait.
    reqs = [SimRequest(0, 0.0, 1000, 2, [0, 1]), SimRequest(1, 0.5, 1000, 2, [2, 3]),
            SimRequest(2, 1.0, 1000, 2, [4, 5])]
    routes = [fixed(None), fixed("prefill-0"), fixed("prefill-0", "decode-1")]
    sim = Simulator(TINY, lambda views, req: routes[req.rid](views, req), prefill=1,
                    decode=2, stage_reject_wait_s=0.5)
    sim.run(reqs)
    assert [r.rejected for r in reqs] == ["", "prefill", ""]
    assert reqs[2].ttft == pytest.approx(2.6) and reqs[1].done is None
    assert sim.workers["decode-0"].kv.used == 0  # B never held blocks there


def test_prefill_worker_steps_batch_the_queued_prompts_as_the_live_scheduler_does():
    """Live, a prefill worker's step takes every queued prompt that fits its token
    budget, and each ends with the step: the first of a batch waits for the others."""
    beats = []
    reqs = [SimRequest(i, 0.0, 600, 2, [2 * i, 2 * i + 1]) for i in range(3)]
    sim = Simulator(TINY, fixed("prefill-0"), prefill=1, decode=1)
    real = sim.registry.heartbeat
    sim.registry.heartbeat = lambda hb, now=None: beats.append(hb) or real(hb, now=now)
    sim.run(reqs)
    steps = [s for hb in beats if hb.worker_id == "prefill-0" for s in hb.prefill_steps]
    # The first prompt found the worker idle; the two queued behind it share a step.
    assert [s.tokens for s in steps] == [[600], [600, 600]]
    alone = 0.1 + 0.6 + 1e-6 * 600 * 300  # prefill(600, 0): 0.88 s
    both = 0.1 + 1.2 + 2e-6 * 600 * 300  # one step of two: the fixed cost once
    assert [s.seconds for s in steps] == pytest.approx([alone, both])
    # Each prompt's KV crosses the 1 MB/s link after its step, one after another.
    assert [r.ttft for r in reqs] == pytest.approx(
        [alone + 0.6, alone + both + 0.6, alone + both + 1.2])


def test_a_prompt_cut_by_the_step_budget_finishes_first_in_the_next_step():
    beats = []
    reqs = [SimRequest(0, 0.0, 600, 2, [0, 1]), SimRequest(1, 0.1, 1500, 2, [2, 3, 4]),
            SimRequest(2, 0.1, 1000, 2, [5, 6])]
    sim = Simulator(TINY, fixed("prefill-0"), prefill=1, decode=1)
    real = sim.registry.heartbeat
    sim.registry.heartbeat = lambda hb, now=None: beats.append(hb) or real(hb, now=now)
    sim.run(reqs)
    steps = [s for hb in beats if hb.worker_id == "prefill-0" for s in hb.prefill_steps]
    # 1,500 + 548 of the 1,000 fill the 2,048-token budget; the other 452 go next.
    assert [(s.tokens, s.cached) for s in steps] == [
        ([600], [0]), ([1500, 548], [0, 0]), ([452], [548])]
    second = 0.1 + 2.048 + 1e-6 * (1500 * 750 + 548 * 274)
    third = 0.1 + 0.452 + 1e-6 * 452 * (226 + 548)
    assert [s.seconds for s in steps[1:]] == pytest.approx([second, third])
    end2 = steps[0].seconds + second
    assert reqs[1].ttft == pytest.approx(end2 + 1.5 - 0.1)  # 1.5 s on the link
    assert reqs[2].ttft == pytest.approx(max(end2 + 1.5, end2 + third) + 1.0 - 0.1)
