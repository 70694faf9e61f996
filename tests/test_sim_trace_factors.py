"""The host's step factors refitted from live step traces (services/sim/trace_factors.py):
which steps ran alone or beside a busy worker, their ratio to what the simulator
charges, and the profile written from them."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from common.cost_profile import CostProfile, load_profile, save_profile
from services.sim import trace_factors as tf
from services.sim.profiles import Profile, neighbour_class

T0 = 1_800_000_000.0
CTX = 100  # context tokens a sequence


def cost_profile(**kw) -> CostProfile:
    base = dict(name="p", prefill_fixed_s=0.1, prefill_per_token_s=1e-3,
                prefill_per_pair_s=1e-6, decode_fixed_s=0.01, decode_per_seq_s=1e-3,
                decode_per_ctx_token_s=1e-5, kv_bytes_per_token=1000, block_size=16,
                link_bandwidth=1e6, contention=[1.0, 1.1],
                fit={"host": {"decode_contention": [1.2, 1.5],
                              "prefill_contention": [1.0, 1.1]}})
    return CostProfile(**{**base, **kw})


CP = cost_profile()
PROF = Profile.from_cost_profile(CP, kv_blocks=1)


def line(end: float, ms: float, chunks: int = 0, batch: int = 0, tokens: int = 0) -> str:
    stamp = datetime.fromtimestamp(end, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return (f"{stamp} [debug    ] step                           chunks={chunks} "
            f"decode={batch} ms={ms:.3f} prefill={tokens}")


def decode_s(batch: int, busy: int) -> float:
    return PROF.decode_step_s(batch, batch * CTX) * PROF.contended(busy, "decode")


def test_step_lines_are_read_with_their_start_and_kind():
    text = "\n".join([line(T0 + 1.0, 500.0, chunks=2, batch=3, tokens=900),
                      "2026-12-02T09:17:18Z [info     ] routed   decode=decode-1",
                      "not-a-time [debug] step chunks=0 decode=1 ms=5.0 prefill=0",
                      line(T0 + 1.2, 50.0, batch=4)])
    steps = tf.read_steps(text)
    assert [(s.chunks, s.batch, s.tokens, s.kind) for s in steps] == \
        [(2, 3, 900, "prefill"), (0, 4, 0, "decode")]
    assert steps[0].start == pytest.approx(T0 + 0.5, abs=1e-5)
    assert steps[1].end - steps[1].start == pytest.approx(0.05, abs=1e-5)


def test_steps_alone_and_beside_a_busy_worker_against_the_charge():
    a, b, t = [], [], T0
    a.append(line(t + 1.0, 1000.0, batch=1))  # the warm-up: left out
    t += 1.0
    for _ in range(2):  # alone, at 1.1 x the one-busy charge
        t += decode_s(2, 1) * 1.1
        a.append(line(t, decode_s(2, 1) * 1.1e3, batch=2))
    # b prefills 600 tokens in 2 chunks for exactly the next two steps of a, which run
    # at 1.3 x the two-busy charge; b's own step, all of it beside a's, at 0.9 x.
    start = t
    for _ in range(2):
        t += decode_s(2, 2) * 1.3
        a.append(line(t, decode_s(2, 2) * 1.3e3, batch=2))
    b.append(line(start - 5.0, 200.0, batch=1))  # b's warm-up, long before
    b.append(line(t, (t - start) * 1e3, chunks=2, tokens=600))
    # a's step half beside b's next one: left out of both.
    a.append(line(t + 0.1, 100.0, batch=2))
    b.append(line(t + 0.15, 100.0, batch=1))
    traces = {"a": tf.read_steps("\n".join(a)), "b": tf.read_steps("\n".join(b))}
    got = tf.step_factors(traces, PROF, CTX)
    # b's 600-token prefill is a long prompt: what a's two busy steps ran beside.
    assert sorted(got) == [("decode", 1, ""), ("decode", 2, "long prefill"),
                           ("prefill", 2, "decode")]
    engine = PROF.decode_step_s(2, 2 * CTX)
    assert got[("decode", 1, "")] == pytest.approx([1.1 * decode_s(2, 1) / engine] * 2,
                                                   rel=1e-3)
    assert got[("decode", 2, "long prefill")] == pytest.approx(
        [1.3 * decode_s(2, 2) / engine] * 2, rel=1e-3)
    # b's prefill priced as two chunks of 300 tokens with one fixed cost, no factor.
    charged = 0.1 + 600e-3 + 2 * 1e-6 * 300 * 150
    assert got[("prefill", 2, "decode")] == pytest.approx([(t - start) / charged], rel=1e-3)
    # Alone: a's two steps after its warm-up, none of b's (its only other one is beside a).
    assert tf.alone_decode_s(traces, "a") == {2: pytest.approx([1.1 * decode_s(2, 1)] * 2,
                                                               rel=1e-3)}
    assert tf.alone_decode_s(traces, "b") == {}


def test_neighbour_class_by_what_the_step_prefills():
    assert [neighbour_class(n) for n in (0, 64, 255, 256, 1777)] == \
        ["decode", "short prefill", "short prefill", "long prefill", "long prefill"]


def test_refit_sets_factors_and_weights_per_neighbour(tmp_path):
    factors = {("decode", 1, ""): [1.4] * 30,
               ("decode", 2, "decode"): [1.6, 1.7, 1.8] * 10,   # median 1.7: the top
               ("decode", 2, "long prefill"): [1.2] * 25,       # below alone: weight 0
               ("decode", 2, "short prefill"): [1.55] * 20,     # half-way: 0.5
               ("prefill", 2, "decode"): [1.5] * 5,             # too few: kept
               ("prefill", 1, ""): [0.5] * 40}                  # held at 1
    new = tf.refit_host(CP, factors, "p-v2", "refitted")
    host = new.fit["host"]
    assert host["decode_contention"] == [1.4, 1.7]
    assert host["prefill_contention"] == [1.0, 1.1]
    assert host["neighbour_weights"] == {"decode": {"decode": 1.0, "long prefill": 0.0,
                                                    "short prefill": 0.5}}
    assert host["from_traces"]["steps_and_median_factor"]["decode x2 beside long prefill"] \
        == [25, 1.2]
    assert new.name == "p-v2" and new.notes.endswith("refitted")
    assert new.contention == CP.contention  # what the conductor predicts with: as it was
    # The simulator of the written profile charges the new factors and weights.
    back = Profile.from_cost_profile(load_profile(str(save_profile(new, tmp_path / "p.json"))),
                                     kv_blocks=1)
    assert back.decode_contention == (1.4, 1.7)
    assert back.weight("decode", "long prefill") == 0.0
    assert back.weight("decode", "short prefill") == 0.5
    assert back.weight("prefill", "decode") == 1.0  # not measured: a whole busy process
    assert back.contended(1 + back.weight("decode", "short prefill"), "decode") == \
        pytest.approx(1.55)


def test_refit_refuses_what_it_cannot_fit():
    with pytest.raises(ValueError, match="no \\(kind, busy\\) has 20"):
        tf.refit_host(CP, {("decode", 2, "decode"): [1.2] * 19}, "x", "n")
    with pytest.raises(ValueError, match="no fit.host decode_contention"):
        tf.refit_host(cost_profile(fit={}), {("decode", 2, "decode"): [1.2] * 30}, "x", "n")
    # Factors kept from falling as the busy count grows.
    up = tf.refit_host(CP, {("decode", 1, ""): [1.8] * 20}, "x", "n")
    assert up.fit["host"]["decode_contention"] == [1.8, 1.8]


def test_context_term_from_steps_alone_at_two_contexts():
    engine = PROF.shape(2) * PROF.contended(1, "decode")
    alone = {("decode", 2, 100.0): [0.05] * 12,
             ("decode", 2, 600.0): [0.05 + 2 * 500 * 1e-5 * engine] * 12,
             ("unified", 2, 100.0): [0.06] * 12,
             ("unified", 2, 600.0): [0.06 + 2 * 500 * 3e-5 * engine] * 12,
             ("unified", 1, 600.0): [0.03] * 12,     # one context only: no slope
             ("decode", 4, 100.0): [0.09] * 3, ("decode", 4, 600.0): [0.01] * 30}  # few
    per, used = tf.context_term(alone, PROF)
    assert per == pytest.approx(2e-5)  # the median of 1e-5 and 3e-5
    assert [(r[0], r[1]) for r in used] == [("decode", 2), ("unified", 2)]
    # Shorter steps at the longer context: a slope <= 0, which the caller does not use.
    flat = {("decode", 1, 100.0): [0.05] * 10, ("decode", 1, 800.0): [0.045] * 10}
    assert tf.context_term(flat, PROF)[0] < 0
    assert tf.context_term({("decode", 1, 100.0): [0.05] * 10}, PROF) is None
