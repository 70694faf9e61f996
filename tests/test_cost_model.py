"""The online cost model: calibration prior, convergence on noisy synthetic timings,
tracking a worker that slows down, and the closed-form helpers."""

from __future__ import annotations

import random

import pytest

from common.records import CostCoefficients
from services.conductor.cost_model import (
    CostModel,
    pool_fetch_time,
    transfer_time,
)

TRUE = CostCoefficients(prefill_fixed_s=0.02, prefill_per_token_s=79e-6, prefill_per_pair_s=1.5e-9,
                   decode_fixed_s=0.015, decode_per_seq_s=1e-4, decode_per_ctx_token_s=35e-9)
# A calibration off by 2x, 0.5x and 3x: what the fit has to walk away from.
PRIOR = CostCoefficients(prefill_fixed_s=0.04, prefill_per_token_s=40e-6, prefill_per_pair_s=4.5e-9,
                    decode_fixed_s=0.03, decode_per_seq_s=0.5e-4, decode_per_ctx_token_s=70e-9)


def true_prefill(k: CostCoefficients, n: int, c: int) -> float:
    return k.prefill_fixed_s + k.prefill_per_token_s * n + k.prefill_per_pair_s * n * (n / 2 + c)


def true_decode(k: CostCoefficients, b: int, ctx: int) -> float:
    return k.decode_fixed_s + k.decode_per_seq_s * b + k.decode_per_ctx_token_s * ctx


def feed(model: CostModel, truth: CostCoefficients, rng: random.Random, count: int,
         noise: float) -> None:
    for _ in range(count):
        n, c = rng.randint(1, 16_000), rng.choice([0, rng.randint(0, 32_000)])
        model.observe_prefill(n, c, true_prefill(truth, n, c) * rng.gauss(1, noise))
        b = rng.randint(1, 128)
        ctx = b * rng.randint(100, 20_000)
        model.observe_decode(b, ctx, true_decode(truth, b, ctx) * rng.gauss(1, noise))


def test_before_any_observation_predictions_are_the_calibration():
    m = CostModel(TRUE)
    assert m.predict_prefill(8192, 0) == pytest.approx(true_prefill(TRUE, 8192, 0))
    assert m.predict_prefill(512, 7680) == pytest.approx(true_prefill(TRUE, 512, 7680))
    assert m.predict_decode(32, 384_000) == pytest.approx(true_decode(TRUE, 32, 384_000))
    assert m.predict_prefill(0, 100) == 0.0 and m.predict_decode(0, 0) == 0.0
    assert m.observations == (0, 0)


def test_fit_converges_to_true_coefficients_from_a_wrong_prior_under_noise():
    m = CostModel(PRIOR)
    feed(m, TRUE, random.Random(7), 3000, noise=0.05)
    got, want = m.coefficients(), TRUE
    for name in CostCoefficients.__slots__:
        assert getattr(got, name) == pytest.approx(getattr(want, name), rel=0.08), name
    for n, c in [(100, 0), (8192, 0), (512, 16_000), (64_000, 0)]:
        assert m.predict_prefill(n, c) == pytest.approx(true_prefill(TRUE, n, c), rel=0.02)
    assert m.predict_decode(64, 640_000) == pytest.approx(true_decode(TRUE, 64, 640_000),
                                                          rel=0.02)
    assert m.observations == (3000, 3000)


def test_forgetting_follows_a_worker_that_slows_down():
    slow = CostCoefficients(*(2 * getattr(TRUE, n) for n in CostCoefficients.__slots__))
    m = CostModel(TRUE, forgetting=0.99)
    rng = random.Random(3)
    feed(m, TRUE, rng, 500, noise=0.0)
    feed(m, slow, rng, 1000, noise=0.0)
    assert m.predict_prefill(8192, 0) == pytest.approx(true_prefill(slow, 8192, 0), rel=0.01)
    assert m.predict_decode(16, 100_000) == pytest.approx(true_decode(slow, 16, 100_000),
                                                          rel=0.01)


def test_queue_time_of_equal_prompts_is_their_sum():
    m = CostModel(TRUE)
    assert m.prefill_queue_time(4, 4000) == pytest.approx(4 * m.predict_prefill(1000, 0))
    assert m.prefill_queue_time(0, 0) == 0.0
    assert m.prefill_queue_time(0, 1000) == pytest.approx(m.predict_prefill(1000, 0))


def test_transfer_and_pool_fetch_times():
    assert transfer_time(3.9e9, 100e9) == pytest.approx(0.039)
    assert pool_fetch_time(10, 512 * 327_680, 25e9) == pytest.approx(10 * 512 * 327_680 / 25e9)
    assert pool_fetch_time(0, 1, 1) == 0.0
    with pytest.raises(ValueError, match="bandwidth"):
        transfer_time(1, 0)
    with pytest.raises(ValueError, match="blocks"):
        pool_fetch_time(-1, 1, 1)


def test_bad_inputs_are_explicit_errors():
    with pytest.raises(ValueError, match="prefill_per_pair_s"):
        CostCoefficients(0.01, 1e-4, 0.0, 0.01, 1e-3, 1e-7)
    m = CostModel(TRUE)
    with pytest.raises(ValueError, match="cached"):
        m.predict_prefill(10, -1)
    with pytest.raises(ValueError, match="observed time"):
        m.observe_decode(1, 10, -0.5)
    with pytest.raises(ValueError, match="forgetting"):
        CostModel(TRUE, forgetting=0.0)


def test_an_observation_far_off_the_calibration_is_refused_and_fits_nothing():
    m = CostModel(PRIOR)
    before = (m.predict_prefill(1000, 0), m.predict_decode(8, 1000))
    for seconds in (0.0, 1e-300, true_prefill(PRIOR, 1000, 0) * 101):
        with pytest.raises(ValueError, match="not within 100x"):
            m.observe_prefill(1000, 0, seconds)
    with pytest.raises(ValueError, match="not within 100x"):
        m.observe_decode(8, 1000, true_decode(PRIOR, 8, 1000) / 101)
    assert (m.predict_prefill(1000, 0), m.predict_decode(8, 1000)) == before
    # 99x either way is a measurement (a much slower or faster machine): it is fitted.
    m.observe_prefill(1000, 0, true_prefill(PRIOR, 1000, 0) * 99)
    assert m.predict_prefill(1000, 0) > before[0]


def test_observations_that_do_not_span_all_terms_still_solve():
    m = CostModel(PRIOR)
    for _ in range(200):  # one prompt length only: the three prefill terms are collinear
        m.observe_prefill(4096, 0, true_prefill(TRUE, 4096, 0))
    assert m.predict_prefill(4096, 0) == pytest.approx(true_prefill(TRUE, 4096, 0), rel=5e-3)
    assert m.predict_decode(8, 1000) == pytest.approx(true_decode(PRIOR, 8, 1000))


def test_one_formula_behind_profile_model_and_fit():
    from common.cost_profile import (
        CostProfile,
        cost,
        decode_terms,
        prefill_step_terms,
        prefill_terms,
    )

    prof = CostProfile("t", *(getattr(TRUE, f) for f in TRUE.__slots__),
                       kv_bytes_per_token=1, block_size=16, link_bandwidth=1.0)
    model = CostModel(CostCoefficients(*prof.coefficients()))
    assert prefill_terms(100, 30) == (1.0, 100, 100 * (50 + 30))
    assert decode_terms(8, 5000) == (1.0, 8, 5000)
    for n, c in [(1, 0), (100, 30), (512, 7680), (8192, 0), (3, 100_000)]:
        want = true_prefill(TRUE, n, c)
        terms = cost(prof.prefill_coefficients, prefill_terms(n, c))
        assert terms == pytest.approx(want, rel=1e-12)
        assert prof.prefill_s(n, c) == terms == model.predict_prefill(n, c)
        assert prof.prefill_step_s([(n, c)]) == pytest.approx(want, rel=1e-12)
    for b, k in [(1, 0), (8, 5000), (64, 384_000)]:
        want = true_decode(TRUE, b, k)
        assert prof.decode_step_s(b, k) == model.predict_decode(b, k) == pytest.approx(want)
    # a step prefilling several chunks pays the fixed cost once
    chunks = [(100, 0), (50, 200), (7, 9)]
    assert prefill_step_terms(chunks) == (1.0, 157, sum(prefill_terms(n, c)[2]
                                                         for n, c in chunks))
    assert prof.prefill_step_s(chunks) == pytest.approx(
        sum(true_prefill(TRUE, n, c) for n, c in chunks) - 2 * TRUE.prefill_fixed_s)
    assert prof.prefill_step_s([]) == 0.0 and prof.prefill_s(0, 5) == 0.0
    # the queue of r equal prompts is r of them, by the same formula
    assert model.prefill_queue_time(4, 4000) == pytest.approx(4 * prof.prefill_s(1000, 0))
