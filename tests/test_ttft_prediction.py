"""What the cache-aware policy predicts for a prompt prefilled on a decode worker that
is already decoding (each prefill step carries its batch's decode), and on a host whose
workers share its cores (the profile's contention factor)."""

from __future__ import annotations

import dataclasses

import pytest

from services.conductor.cache_policy import CacheAwarePolicy, Decision
from services.conductor.cost_model import CostModel
from services.conductor.prefix_index import PrefixIndex
from tests.test_cache_policy import CAL, CFG, PROMPT, policy, prefill_s, route, view
from tests.test_inflight import T0, _beat, _setup


def decode_s(batch: int, context: int) -> float:
    return CAL.decode_fixed_s + CAL.decode_per_seq_s * batch + CAL.decode_per_ctx_token_s * context


TRANSFER = PROMPT * CFG.kv_bytes_per_token / CFG.link_bandwidth
P = prefill_s(PROMPT, 0)


def test_local_prefill_behind_queued_prompts_counts_the_decodes_riding_every_step():
    # Four decoding, two prompts of its own queued: the step in progress (all six
    # counted), then three prefill steps (two ahead, this one) each with the four's decode.
    d1 = view("d1", "decode", running=4, waiting=2, queued=2 * PROMPT)
    d = route(policy(), [d1], hashes=[], slo_ttft_s=60)
    assert d.prefill is None
    assert d.predicted_ttft_s == pytest.approx(3 * P + decode_s(6, 0) + 3 * decode_s(4, 0))


def test_the_local_fallback_past_the_kv_lease_counts_what_was_routed_there_meanwhile():
    # The prefill worker is ~17 s behind: past the 10 s lease, so prompts go local.
    d1 = view("d1", "decode", running=4, waiting=2, queued=2 * PROMPT)
    p1 = view("p1", "prefill", waiting=20, queued=20 * PROMPT)
    reg, pol = _setup(d1, p1), policy()
    first = route(pol, [d1, p1], hashes=[1], slo_ttft_s=60, request_id="a", routed_at=T0)
    assert first.prefill is None and "KV lease" in first.reason
    assert first.predicted_ttft_s == pytest.approx(3 * P + decode_s(6, 0) + 3 * decode_s(4, 0))
    # A heartbeat sent before "a" reached d1 leaves it counted: the next waits for it too
    # (and its KV: "a" is in the batch whose step is in progress).
    assert reg.heartbeat(_beat("d1", "decode", running=4, waiting=2,
                               queued_prefill_tokens=2 * PROMPT), now=T0 + 0.05)
    p1.waiting, p1.queued_prefill_tokens = 20, 20 * PROMPT
    second = route(pol, [d1, p1], hashes=[2], slo_ttft_s=60, request_id="b",
                   routed_at=T0 + 0.1)
    assert second.prefill is None
    assert second.predicted_ttft_s == pytest.approx(
        4 * P + decode_s(7, PROMPT) + 4 * decode_s(4, PROMPT))


def _shared_host_policy(contention):
    return CacheAwarePolicy(PrefixIndex(), CostModel(CAL),
                            dataclasses.replace(CFG, contention=contention))


@pytest.mark.parametrize("other_host,factor", [(False, 2.0), (True, 1.0)])
def test_a_busy_neighbour_on_the_host_slows_the_predicted_prefill(other_host, factor):
    d1, p1 = view("d1", "decode"), view("p1", "prefill")
    if other_host:
        p1.info = dataclasses.replace(p1.info, host_id="h2")
    pol = _shared_host_policy((1.0, 2.0))
    first = route(pol, [d1, p1], hashes=[1], slo_ttft_s=60, request_id="a", routed_at=T0)
    # Nothing busy yet: the profile's own prefill, locally.
    assert first.prefill is None and first.predicted_ttft_s == pytest.approx(P)
    # d1 now prefills "a": a local prefill would stall it, so the prompt goes to p1,
    # whose prefill runs beside d1's (twice as slow on their shared host), after d1
    # forwards it at the end of its step.
    second = route(pol, [d1, p1], hashes=[2], slo_ttft_s=60, request_id="b",
                   routed_at=T0 + 0.1)
    assert isinstance(second, Decision) and second.prefill is p1
    assert second.predicted_ttft_s == pytest.approx(P + factor * P + TRANSFER)


def test_contention_factors_below_one_are_refused():
    with pytest.raises(ValueError, match="contention"):
        dataclasses.replace(CFG, contention=(0.5,))
