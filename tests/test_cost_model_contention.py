"""Host contention counted once: the cost model is fitted in one-worker-alone units
(each reported step divided by the factor of its host's busy workers, as the policy
counts them) and the policy multiplies its predictions by the factor of the host as it
stands, so a step measured at the two-busy factor is predicted at that time with two
busy, not at the factor squared."""

from __future__ import annotations

import dataclasses

import pytest

from common.cost_profile import CostProfile
from common.protocol import StepSample
from services.conductor.cache_policy import CacheAwarePolicy, Decision
from services.conductor.contention import busy_by_host, busy_on_host, host_factor
from services.conductor.cost_model import CostModel
from services.conductor.prefix_index import PrefixIndex
from services.conductor.router import Router, RouterConfig, fit_step_samples, reporting_busy
from tests.test_cache_policy import CAL, CFG, PROMPT, prefill_s, route, view
from tests.test_cost_model import PRIOR, TRUE, true_decode, true_prefill
from tests.test_inflight import T0

TWO = 1.5  # the two-busy factor in these tests
FACTORS = (1.0, TWO, 2.0)
TRANSFER = PROMPT * CFG.kv_bytes_per_token / CFG.link_bandwidth
SIZES = [(n, c) for n in (64, 700, 2000, 6000, 16_000) for c in (0, 3000)]


def test_the_factor_is_per_busy_count_the_last_beyond_the_list_one_without_factors():
    assert [host_factor(FACTORS, k) for k in (0, 1, 2, 3, 7)] == [1.0, 1.0, TWO, 2.0, 2.0]
    assert host_factor((), 5) == 1.0


def test_steps_measured_at_the_two_busy_factor_fit_the_worker_alone():
    m = CostModel(PRIOR, contention=FACTORS)
    for _ in range(200):
        for n, c in SIZES:
            m.observe_prefill(n, c, TWO * true_prefill(TRUE, n, c), busy=2)
        for b, ctx in ((1, 500), (8, 40_000), (64, 600_000)):
            m.observe_decode(b, ctx, TWO * true_decode(TRUE, b, ctx), busy=2)
    # Alone: the worker's own time; with two busy (the policy's factor), the measured.
    for n, c in [(512, 0), (8192, 1024)]:
        assert m.predict_prefill(n, c) == pytest.approx(true_prefill(TRUE, n, c), rel=0.03)
        assert host_factor(m.contention, 2) * m.predict_prefill(n, c) == pytest.approx(
            TWO * true_prefill(TRUE, n, c), rel=0.03)
    assert m.predict_decode(16, 100_000) == pytest.approx(true_decode(TRUE, 16, 100_000),
                                                          rel=0.03)
    # Without factors nothing is divided: the fit is of the steps as measured.
    raw = CostModel(PRIOR)
    for _ in range(200):
        for n, c in SIZES:
            raw.observe_prefill(n, c, TWO * true_prefill(TRUE, n, c), busy=2)
    assert raw.predict_prefill(8192, 0) == pytest.approx(TWO * true_prefill(TRUE, 8192, 0),
                                                         rel=0.03)


def test_a_step_measured_alone_is_divided_by_the_one_busy_factor():
    # contention[0] > 1: this host alone is slower than the profile's fit; the model
    # stays in the profile's units, which the policy multiplies by 1.2 alone.
    m = CostModel(CAL, contention=(1.2, 1.8))
    for _ in range(50):
        m.observe_prefill(4000, 0, 1.2 * prefill_s(4000, 0), busy=1)
    assert m.predict_prefill(4000) == pytest.approx(prefill_s(4000, 0), rel=1e-9)
    with pytest.raises(ValueError, match="contention"):
        CostModel(CAL, contention=(0.9,))
    with pytest.raises(ValueError, match="busy"):
        m.observe_decode(1, 10, 0.1, busy=-1)


def test_the_reporting_worker_counts_itself_busy_beside_its_hosts_busy_workers():
    d1, p1 = view("d1", "decode", running=2), view("p1", "prefill")
    p2 = view("p2", "prefill", waiting=1, queued=100)
    p2.info = dataclasses.replace(p2.info, host_id="other")
    ws = [d1, p1, p2]
    # p1's heartbeat shows it idle, but it ran the steps it reports: d1 and itself.
    assert reporting_busy(ws, "p1") == 2 == busy_on_host(busy_by_host(ws), p1)
    assert reporting_busy(ws, "d1") == 1 and reporting_busy(ws, "p2") == 1
    assert reporting_busy(ws, "gone") == 1
    d1.alive = False  # a dead worker slows nobody
    assert reporting_busy(ws, "p1") == 1


def test_policy_predicts_a_step_measured_at_two_busy_at_that_time_with_two_busy():
    d1, p1 = view("d1", "decode"), view("p1", "prefill")
    cost = CostModel(CAL, contention=FACTORS)
    pol = CacheAwarePolicy(PrefixIndex(), cost, dataclasses.replace(CFG, contention=FACTORS))
    first = route(pol, [d1, p1], hashes=[1], slo_ttft_s=60, request_id="a", routed_at=T0)
    assert first.prefill is None  # d1 now prefills "a": busy
    # p1's prefill steps, run beside d1's prefill: the two-busy factor times the profile.
    busy = reporting_busy([d1, p1], "p1")
    assert busy == 2
    measured = {n: TWO * prefill_s(n, 0) for n in (500, 2000, PROMPT, 12_000)}
    for _ in range(100):
        used, bad = fit_step_samples(cost, [StepSample(seconds=s, tokens=[n], cached=[0])
                                            for n, s in measured.items()], [], busy)
        assert (used, bad) == (4, 0)
    assert cost.observations == (400, 0)
    second = route(pol, [d1, p1], hashes=[2], slo_ttft_s=60, request_id="b",
                   routed_at=T0 + 0.1)
    assert isinstance(second, Decision) and second.prefill is p1
    # d1's prompt ahead (alone on its host then, x1.0), then p1's prefill at the time
    # measured (x1.5 once, not 1.5 x 1.5), then the transfer.
    assert second.predicted_ttft_s == pytest.approx(
        prefill_s(PROMPT, 0) + measured[PROMPT] + TRANSFER, rel=1e-6)


def test_with_two_busy_the_predicted_tbt_is_the_decode_step_times_the_factor():
    d1 = view("d1", "decode", running=4)
    p1 = view("p1", "prefill", waiting=1, queued=100)
    pol = CacheAwarePolicy(PrefixIndex(), CostModel(CAL, contention=FACTORS),
                           dataclasses.replace(CFG, contention=FACTORS))
    d = route(pol, [d1, p1], hashes=[], slo_ttft_s=60, output_tokens=11)
    step = CAL.decode_fixed_s + CAL.decode_per_seq_s * 5 + CAL.decode_per_ctx_token_s * (
        PROMPT + 5)
    assert d.reason.endswith(f"decode tbt {TWO * step * 1e3:.1f}ms")


def test_the_router_fits_in_the_profiles_units_and_changes_nothing_without_factors():
    base = dict(name="p", prefill_fixed_s=CAL.prefill_fixed_s,
                prefill_per_token_s=CAL.prefill_per_token_s,
                prefill_per_pair_s=CAL.prefill_per_pair_s, decode_fixed_s=CAL.decode_fixed_s,
                decode_per_seq_s=CAL.decode_per_seq_s,
                decode_per_ctx_token_s=CAL.decode_per_ctx_token_s, kv_bytes_per_token=1000,
                block_size=16, link_bandwidth=1e9)
    d1, p1 = view("d1", "decode", running=1), view("p1", "prefill")
    samples = [StepSample(seconds=TWO * prefill_s(n, 0), tokens=[n], cached=[0])
               for n in (500, 4000, 9000)]
    shared = Router(RouterConfig(), CostProfile(**base, contention=FACTORS))
    quiet = Router(RouterConfig(), CostProfile(**base))
    for _ in range(100):
        assert shared.observe(samples, [], "p1", [d1, p1]) == 3
        assert quiet.observe(samples, [], "p1", [d1, p1]) == 3
    assert shared.cost.predict_prefill(4000) == pytest.approx(prefill_s(4000, 0), rel=1e-6)
    assert quiet.cost.predict_prefill(4000) == pytest.approx(TWO * prefill_s(4000, 0),
                                                             rel=0.02)
