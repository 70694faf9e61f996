"""The planner's policy (services/planner/decide.py) and its load projections: exact
decisions for hysteresis, cool-down, min/max and SLO pressure, on made-up loads."""

from __future__ import annotations

import dataclasses

import pytest

from common.protocol import ConductorStats
from common.records import CostCoefficients, WorkerInfo, WorkerStatus
from services.conductor.cost_model import CostModel
from services.planner.decide import HOLD, SCALE_IN, SCALE_OUT, Planner
from services.planner.load import RoleLoad, role_loads
from services.planner.settings import PlannerSettings

# Prefill: 1 ms fixed + 1 ms a token; decode step: 10 ms + 1 ms a sequence.
COEFFS = CostCoefficients(1e-3, 1e-3, 1e-12, 10e-3, 1e-3, 1e-12)
BASE = PlannerSettings(up_ticks=2, down_ticks=3, cooldown_up_s=10, cooldown_down_s=20)


def load(role="decode", alive=1, waiting=0, running=0, tokens=0, used=0, blocks=100):
    return RoleLoad(role=role, alive=alive, waiting=waiting, running=running,
                    queued_prefill_tokens=tokens, used_blocks=used, blocks_per_worker=blocks,
                    block_size=16, cost=CostModel(COEFFS))


def run(planner, role, count, loads, t0=0.0, step=1.0):
    """Decisions for a sequence of looks one ``step`` apart; ``count`` follows them. A
    load may be a function of the count (the workers that serve it)."""
    out = []
    for i, ld in enumerate(loads):
        d = planner.decide(role, count, ld(count) if callable(ld) else ld, t0 + i * step)
        out.append((d.action, d.reason, d.target))
        count = d.target
    return out


def test_min_and_max_act_at_once_without_cool_down():
    p = Planner(dataclasses.replace(BASE, min_decode=2, max_decode=3))
    assert run(p, "decode", 0, [load()] * 3) == [
        (SCALE_OUT, "min", 1), (SCALE_OUT, "min", 2), (HOLD, "steady", 2)]
    p = Planner(dataclasses.replace(BASE, max_decode=3))
    assert run(p, "decode", 5, [load(waiting=50)] * 4) == [
        (SCALE_IN, "max", 4), (SCALE_IN, "max", 3), (HOLD, "steady", 3), (HOLD, "at_max", 3)]


def test_queue_pressure_needs_up_ticks_then_cools_down():
    p = Planner(BASE)
    def busy(n):  # 10 waiting: on 1 worker > queue_high 4
        return load(alive=n, waiting=10)
    got = run(p, "decode", 1, [busy] * 14)
    assert got[:3] == [(HOLD, "steady", 1), (SCALE_OUT, "queue", 2), (HOLD, "steady", 2)]
    # 5 per worker on 2 workers: pressure again, but the cool-down (10 s) holds it.
    assert got[3:11] == [(HOLD, "cooldown", 2)] * 8
    assert got[11] == (SCALE_OUT, "queue", 3)  # 10 s after the first change
    assert got[12:] == [(HOLD, "steady", 3)] * 2  # 3.3 per worker: below queue_high


def test_pressure_at_max_is_held_and_says_so():
    p = Planner(dataclasses.replace(BASE, max_decode=1))
    assert run(p, "decode", 1, [load(waiting=10)] * 3) == [
        (HOLD, "steady", 1), (HOLD, "at_max", 1), (HOLD, "at_max", 1)]


def test_scale_in_judges_one_worker_fewer_and_needs_down_ticks():
    p = Planner(BASE)
    # 3 workers, 60% KV each in use: with 2 it would be 90% > kv_low: stay.
    assert run(p, "decode", 3, [load(alive=3, used=180)] * 6) == [(HOLD, "steady", 3)] * 6
    # 3 workers at 10%: 15% with 2, 30% with 1 (< kv_low 50%); idle for down_ticks
    # looks, then 20 s of cool-down between steps; never below min_decode.
    got = run(Planner(BASE), "decode", 3, [load(alive=3, used=30)] * 30)
    ins = [(i, d) for i, d in enumerate(got) if d[0] == SCALE_IN]
    assert ins == [(2, (SCALE_IN, "idle", 2)), (22, (SCALE_IN, "idle", 1))]


def test_no_flapping_between_the_marks():
    """A load between the low and high marks neither grows nor shrinks the role."""
    p = Planner(dataclasses.replace(BASE, cooldown_up_s=0, cooldown_down_s=0))
    # 2 workers, 3 waiting: 1.5 per worker (<= 4: no pressure), 3 with one (> 0.5: not idle).
    assert run(p, "decode", 2, [load(alive=2, waiting=3)] * 20) == [(HOLD, "steady", 2)] * 20


def test_an_idle_streak_is_broken_by_one_busy_look():
    p = Planner(dataclasses.replace(BASE, cooldown_down_s=0))
    idle, busy = load(alive=2), load(alive=2, waiting=3)
    got = run(p, "decode", 2, [idle, idle, busy, idle, idle, idle])
    assert [a for a, _, _ in got] == [HOLD] * 5 + [SCALE_IN]


def test_slo_pressure_from_predicted_ttft_and_tbt():
    s = dataclasses.replace(BASE, slo_ttft_ms=100, slo_tbt_ms=50, up_ticks=1)
    # Prefill: 1 worker, 2 prompts of 60 queued tokens each: 2 * (1 + 60) ms = 122 ms
    # > 0.8 * 100 ms.
    d = Planner(s).decide("prefill", 1, load("prefill", waiting=2, tokens=120), 0.0)
    assert (d.action, d.reason, d.target) == (SCALE_OUT, "ttft", 2)
    assert "ttft 122ms" in d.detail
    # Decode: 40 running on 1 worker: 10 + 40 = 50 ms > 40 ms.
    d = Planner(s).decide("decode", 1, load(running=40), 0.0)
    assert (d.action, d.reason, d.target) == (SCALE_OUT, "tbt", 2)
    # 2 workers with 30 running: 25 ms at 2, 40 ms at 1 (>= 0.4 * 50): not idle.
    p = Planner(dataclasses.replace(s, cooldown_down_s=0, down_ticks=1))
    assert p.decide("decode", 2, load(alive=2, running=30), 0.0).action == HOLD
    # 2 workers with 8 running: 18 ms with one (< 20 ms): idle.
    d = p.decide("decode", 2, load(alive=2, running=8), 1.0)
    assert (d.action, d.reason, d.target) == (SCALE_IN, "idle", 1)


def test_pressure_is_judged_on_the_workers_serving_now():
    """A scaled-out worker still starting carries nothing: the load stays on the live one."""
    p = Planner(dataclasses.replace(BASE, up_ticks=1, cooldown_up_s=0))
    d = p.decide("decode", 2, load(alive=1, waiting=6), 0.0)
    assert (d.action, d.reason) == (SCALE_OUT, "queue")  # 6 on the one alive


def test_role_loads_from_conductor_stats():
    def status(wid, role, alive=True, **kw):
        info = WorkerInfo(worker_id=wid, role=role, model="m", control_addr="tcp://x:1",
                          kv_addr="", host_id="h", block_size=16, num_blocks=100,
                          fingerprint="f")
        return WorkerStatus(info=info, alive=alive, **kw)
    stats = ConductorStats(
        workers=[status("p0", "prefill", waiting=3, queued_prefill_tokens=300, free_blocks=90),
                 status("d0", "decode", running=5, free_blocks=40, waiting=1),
                 status("d1", "decode", running=3, free_blocks=80),
                 status("d2", "decode", alive=False, running=50, free_blocks=0),
                 status("u0", "unified", running=9)],
        policy="cache_aware", cost_profile="x", cost_model=COEFFS, cost_observations=[0, 0],
        bad_samples=0, index_blocks=0, index_locations={})
    loads = role_loads(stats)
    d = loads["decode"]
    assert (d.alive, d.running, d.waiting, d.used_blocks, d.blocks_per_worker) == (2, 8, 1, 80, 100)
    assert d.at(2).kv == pytest.approx(0.4) and d.at(1).kv == pytest.approx(0.8)
    assert d.at(2).tbt_s == pytest.approx(10e-3 + 4e-3, rel=1e-3)
    pre = loads["prefill"]
    assert (pre.alive, pre.waiting, pre.queued_prefill_tokens) == (1, 3, 300)
    assert pre.at(1).ttft_s == pytest.approx(3 * (1e-3 + 100e-3), rel=1e-3)
    assert role_loads(stats, model="other")["decode"].alive == 0


def test_settings_refuse_what_cannot_work():
    with pytest.raises(ValueError, match="min_decode <= max_decode"):
        PlannerSettings(min_decode=3, max_decode=2)
    with pytest.raises(ValueError, match="down_ratio < up_ratio"):
        PlannerSettings(down_ratio=0.9, up_ratio=0.8)
    with pytest.raises(ValueError, match="actuator must be"):
        PlannerSettings(actuator="docker")
    with pytest.raises(ValueError, match="fewer programs"):
        PlannerSettings(actuator="supervisord", supervisor_url="unix:///x",
                        supervisor_decode=("decode", "decode-2"), max_decode=3)


def test_role_loads_put_back_the_host_contention_the_cost_model_leaves_out():
    """The conductor's cost model predicts a worker alone on its host; the planner's
    projection multiplies by the factor for the workers busy there at that size."""
    def status(wid, role, host, **kw):
        info = WorkerInfo(worker_id=wid, role=role, model="m", control_addr="tcp://x:1",
                          kv_addr="", host_id=host, block_size=16, num_blocks=100,
                          fingerprint="f")
        return WorkerStatus(info=info, alive=True, **kw)
    workers = [status("p0", "prefill", "h", waiting=3, queued_prefill_tokens=300),
               status("d0", "decode", "h", running=8, free_blocks=60),
               status("d1", "decode", "h2", running=8, free_blocks=60),
               status("u0", "unified", "h2")]  # idle: not busy
    stats = ConductorStats(
        workers=workers, policy="cache_aware", cost_profile="x", cost_model=COEFFS,
        cost_observations=[0, 0], bad_samples=0, index_blocks=0, index_locations={},
        contention=[1.0, 1.5, 2.0, 3.0])
    alone = dataclasses.replace(stats, contention=[])
    pre, pre_alone = role_loads(stats)["prefill"], role_loads(alone)["prefill"]
    # Host h: d0 busy beside the prefill worker, so k = 1 + 1 = 2.
    assert (pre.hosts, pre.others_busy) == (1, 1)
    assert pre.at(1).ttft_s == pytest.approx(1.5 * pre_alone.at(1).ttft_s)
    assert pre.at(2).ttft_s == pytest.approx(2.0 * pre_alone.at(2).ttft_s)  # k = 3
    dec, dec_alone = role_loads(stats)["decode"], role_loads(alone)["decode"]
    # Two hosts; on h the prefill worker is busy beside them.
    assert (dec.hosts, dec.others_busy) == (2, 1)
    assert dec.at(2).tbt_s == pytest.approx(1.5 * dec_alone.at(2).tbt_s)  # 1 + 1 a host
    assert dec.at(3).tbt_s == pytest.approx(2.0 * dec_alone.at(3).tbt_s)  # 1 + 2
    assert dec.at(12).tbt_s == pytest.approx(3.0 * dec_alone.at(12).tbt_s)  # the last
    # A role with no work is not slowed (and its prediction is that of no work).
    idle = dataclasses.replace(dec, running=0, waiting=0)
    assert idle.host_factor(4) == 1.0
