"""The TTFT correction: observed first-token times move the conductor's predictions, on
the path and worker they were observed on, within bounds, and admission follows."""

from __future__ import annotations

import pytest

from common.protocol import Heartbeat, TtftSample, WorkerInfo
from common.records import CostCoefficients
from services.conductor.cache_policy import CacheAwarePolicy, PolicyConfig, Rejection
from services.conductor.cost_model import CostModel
from services.conductor.prefix_index import PrefixIndex
from services.conductor.registry import WorkerView
from services.conductor.router import Router, RouterConfig, RouteRequest
from services.conductor.routing_policy import Decision, PolicyRequest
from services.conductor.server import Conductor, ConductorSettings
from services.conductor.ttft_correction import ALL, CorrectionConfig, Expected, TtftCorrection
from tests.cluster import free_port

# 1 ms per prompt token, nothing else: a 500-token remote prefill predicts 0.5 s. The
# decode worker runs one request and may not stall it: the prompt goes remote.
CAL = CostCoefficients(prefill_fixed_s=1e-12, prefill_per_token_s=1e-3, prefill_per_pair_s=1e-15,
                       decode_fixed_s=1e-12, decode_per_seq_s=1e-12, decode_per_ctx_token_s=1e-12)
CFG = PolicyConfig(kv_bytes_per_token=1, link_bandwidth=1e12, max_decode_stall_s=0.0)
N = 5  # min_samples


def _view(wid: str, role: str, running: int = 0) -> WorkerView:
    return WorkerView(WorkerInfo(worker_id=wid, role=role, model="m", control_addr="",
                                 kv_addr="", host_id="h", block_size=16, num_blocks=10_000,
                                 fingerprint="fp"),
                      running=running, waiting=0, queued_prefill_tokens=0, free_blocks=10_000,
                      last_seen=0.0)


def _workers():  # afresh for each decision: one accounts its request on the views
    return [_view("d", "decode", running=1), _view("p", "prefill")]


def _decide(policy, slo_ttft_s: float = float("inf")):
    return policy.decide(_workers(), PolicyRequest(prompt_tokens=500, slo_ttft_s=slo_ttft_s))


def _learn(corr: TtftCorrection, ratio: float, count: int, *, start: int = 0,
           decode: str = "d", prefill: str | None = "p", predicted: float = 0.5) -> int:
    for i in range(start, start + count):
        corr.expect(f"r{i}", Expected(decode, prefill, predicted))
    return corr.observe(decode, [TtftSample(f"r{i}", predicted * ratio, prefill is not None)
                                 for i in range(start, start + count)])


def test_a_slow_path_raises_the_prediction_and_admission_refuses_what_now_misses():
    corr = TtftCorrection(CorrectionConfig(min_samples=N))
    policy = CacheAwarePolicy(PrefixIndex(), CostModel(CAL), CFG, corr)
    d = _decide(policy, slo_ttft_s=0.6)  # 0.5 s predicted: admitted
    assert isinstance(d, Decision) and d.prefill.worker_id == "p"
    assert d.predicted_ttft_s == pytest.approx(0.5)
    assert _learn(corr, 1.3, N - 1) == N - 1
    assert corr.factor("remote", "p") == 1.0  # not enough samples yet
    assert _learn(corr, 1.3, 1, start=N - 1) == 1
    assert corr.factor("remote", "p") == pytest.approx(1.3)
    d = _decide(policy)
    assert "ttft 0.650s (x1.30 learned)" in d.reason, d.reason
    assert d.predicted_ttft_s == pytest.approx(0.5)  # what it learns from stays raw
    no = _decide(policy, slo_ttft_s=0.6)
    assert isinstance(no, Rejection) and no.reason.startswith("predicted TTFT 0.650s")
    assert no.retry_after_s == 1.0
    assert isinstance(_decide(policy, slo_ttft_s=0.66), Decision)


def test_a_fast_worker_lowers_it_and_admits_what_the_raw_prediction_refused():
    corr = TtftCorrection(CorrectionConfig(min_samples=N))
    policy = CacheAwarePolicy(PrefixIndex(), CostModel(CAL), CFG, corr)
    assert isinstance(_decide(policy, slo_ttft_s=0.4), Rejection)  # 0.5 s > 0.4 s
    _learn(corr, 0.7, N)
    assert corr.factor("remote", "p") == pytest.approx(0.7)
    d = _decide(policy, slo_ttft_s=0.4)
    assert isinstance(d, Decision) and "ttft 0.350s" in d.reason, d


def test_the_quantile_of_the_window_and_a_changing_worker():
    corr = TtftCorrection(CorrectionConfig(min_samples=N, window=10, quantile=0.9))
    _learn(corr, 1.0, 9)
    _learn(corr, 2.0, 1, start=9)
    assert corr.factor("remote", "p") == pytest.approx(1.0)  # 9 of 10 within 1.0
    _learn(corr, 2.0, 1, start=10)
    assert corr.factor("remote", "p") == pytest.approx(2.0)  # the 90th is now 2.0
    _learn(corr, 1.2, 10, start=11)  # the worker got faster: old samples leave the window
    assert corr.factor("remote", "p") == pytest.approx(1.2)


def test_margin_applies_to_admission_only():
    corr = TtftCorrection(CorrectionConfig(margin=1.25))
    policy = CacheAwarePolicy(PrefixIndex(), CostModel(CAL), CFG, corr)
    d = _decide(policy, slo_ttft_s=0.63)  # 0.5 x 1.25 = 0.625
    assert isinstance(d, Decision) and "ttft 0.500s;" in d.reason
    no = _decide(policy, slo_ttft_s=0.62)
    assert isinstance(no, Rejection) and "x1.25 margin" in no.reason


def test_absurd_samples_are_clamped_and_foreign_ones_ignored():
    corr = TtftCorrection(CorrectionConfig(min_samples=N, max_ratio=4.0))
    _learn(corr, 2e9, N)  # a worker claiming 1e9 s
    assert corr.factor("remote", "p") == 4.0 and corr.clamped == N
    _learn(corr, 0.0, 32, start=N)  # then 0 s, a whole window of them
    assert corr.factor("remote", "p") == 0.25 and corr.clamped == N + 32
    # Not routed to the worker that reports it, never routed, the wrong path, reported
    # twice, not a finite number of seconds: none counts.
    corr.expect("x", Expected("d", "p", 0.5))
    corr.expect("nan", Expected("d", "p", 0.5))
    before = corr.used
    assert corr.observe("other-decode", [TtftSample("x", 5.0, True)]) == 0
    assert corr.observe("d", [TtftSample("never", 5.0, True), TtftSample("x", 5.0, False),
                              TtftSample("nan", float("nan"), True),
                              TtftSample("nan", float("inf"), True)]) == 0
    assert corr.observe("d", [TtftSample("x", 0.5, True)]) == 1
    assert corr.observe("d", [TtftSample("x", 0.5, True)]) == 0
    assert corr.used == before + 1 and corr.unmatched == 6


def test_bounded_memory_and_path_wide_factor_for_a_new_worker():
    corr = TtftCorrection(CorrectionConfig(min_samples=N, max_pending=100))
    for i in range(1000):
        corr.expect(f"q{i}", Expected("d", "p", 0.5))
    assert corr.pending == 100
    assert corr.observe("d", [TtftSample("q0", 1.0, True)]) == 0  # the oldest went first
    _learn(corr, 1.5, N, prefill="p")
    assert corr.factor("remote", "p2") == pytest.approx(1.5)  # the path's, for a new one
    assert corr.factor("local", "d") == 1.0  # another path learnt nothing
    _learn(corr, 2.0, N, start=100, prefill=None)
    assert corr.factor("local", "d") == pytest.approx(2.0)
    corr.forget("p")
    assert corr.factor("remote", "p") == pytest.approx(1.5)  # its own gone, the path's kept
    assert [(f.path, f.worker_id, f.samples) for f in corr.factors()] == [
        ("local", ALL, N), ("local", "d", N), ("remote", ALL, N)]
    off = TtftCorrection(CorrectionConfig(enabled=False, min_samples=1))
    _learn(off, 3.0, 3)
    assert off.factor("remote", "p") == 1.0
    with pytest.raises(ValueError, match="margin"):
        CorrectionConfig(margin=0.9)
    with pytest.raises(ValueError, match="max_ratio"):
        CorrectionConfig(max_ratio=0.5)


async def test_conductor_learns_from_heartbeats_and_reports_it_in_metrics():
    cond = Conductor(ConductorSettings(
        control_addr=f"tcp://127.0.0.1:{free_port()}",
        heartbeat_addr=f"tcp://127.0.0.1:{free_port()}", heartbeat_interval_s=60.0,
        ttft_correction_min_samples=2))
    await cond.start()
    try:
        for w in (_view("d", "decode", running=1), _view("p", "prefill")):
            assert cond.registry.admit(w) is None
        router: Router = cond.router
        ws = list(cond.registry.workers.values())
        predicted = []
        for i in range(2):
            d = router.route(ws, RouteRequest(model="m", prompt_len=530), f"rid{i}")
            assert d.prefill.worker_id == "p"
            predicted.append(d.predicted_ttft_s)
        hb = Heartbeat(worker_id="d", role="decode", seq=1, waiting=0, running=0,
                       queued_prefill_tokens=0, free_blocks=10_000, total_blocks=10_000,
                       step_time_ms=0.0, ttft_samples=[
                           TtftSample(f"rid{i}", 1.5 * t, True)
                           for i, t in enumerate(predicted)])
        assert cond.apply_heartbeat(hb)
        assert router.correction.factor("remote", "p") == pytest.approx(1.5)
        text = cond.metrics.get_sample_value
        assert text("pdserve:ttft_correction_factor",
                    {"path": "remote", "worker": "p"}) == pytest.approx(1.5)
        assert text("pdserve:ttft_samples_total", {"outcome": "used"}) == 2
    finally:
        await cond.close()


def test_router_config_carries_the_settings():
    s = ConductorSettings(ttft_margin=1.2, ttft_correction_quantile=0.5,
                          ttft_correction_max_ratio=3.0, ttft_correction=False)
    c = s.router_config().correction
    assert (c.margin, c.quantile, c.max_ratio, c.enabled) == (1.2, 0.5, 3.0, False)
    assert isinstance(RouterConfig().correction, CorrectionConfig)
