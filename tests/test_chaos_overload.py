"""Admission under overload, as ``bench/chaos_overload.py`` measures it.

The policy: a remote prefill cannot start before the decode worker has taken the request
between two engine steps, so the prompts that decode worker prefills itself are ahead of
it; the predicted TTFT counts them, and a request they would push past its SLO is refused.

Through real processes (simulated workers, the smollm2-cpu timings unscaled, so a
530-token prompt takes ~1.3 s): a burst at ten times what the cluster can prefill, each
request with a 5 s TTFT SLO. At least 90 % of the admitted get their first token within
it; every other request is refused at once with 429 and Retry-After, none answered 503
or anything else, and nothing runs on once the burst is answered.
"""

from __future__ import annotations

import pytest

from bench import chaos_overload
from common.protocol import WorkerInfo
from common.records import CostCoefficients
from services.conductor.cache_policy import CacheAwarePolicy, PolicyConfig, Rejection
from services.conductor.cost_model import CostModel
from services.conductor.prefix_index import PrefixIndex
from services.conductor.registry import WorkerView
from services.conductor.routing_policy import PolicyRequest

CAL = CostCoefficients(prefill_fixed_s=1e-12, prefill_per_token_s=1e-3, prefill_per_pair_s=1e-15,
                       decode_fixed_s=0.02, decode_per_seq_s=1e-3, decode_per_ctx_token_s=1e-12)
CFG = PolicyConfig(kv_bytes_per_token=1, link_bandwidth=1e12)


def _view(wid: str, role: str, *, waiting: int = 0, queued: int = 0) -> WorkerView:
    return WorkerView(WorkerInfo(worker_id=wid, role=role, model="m", control_addr="",
                                 kv_addr="", host_id="h", block_size=16, num_blocks=10_000,
                                 fingerprint="fp"),
                      running=0, waiting=waiting, queued_prefill_tokens=queued,
                      free_blocks=10_000, last_seen=0.0)


def _route(workers, slo_ttft_s: float):
    policy = CacheAwarePolicy(PrefixIndex(), CostModel(CAL), CFG)
    return policy.decide(workers, PolicyRequest(prompt_tokens=500, block_hashes=[],
                                                block_size=16, slo_ttft_s=slo_ttft_s))


def test_remote_ttft_counts_the_local_prefills_queued_on_the_decode_worker():
    # 500 tokens: 0.5 s to prefill anywhere. The decode worker has 2000 tokens (2 s) of
    # its own prompts queued, so the remote prefill starts only after them: 2.5 s.
    def busy():  # afresh for each decision: one accounts its request on the views
        return [_view("d", "decode", waiting=2, queued=2000), _view("p", "prefill")]

    d = _route(busy(), slo_ttft_s=2.6)
    assert d.prefill.worker_id == "p", d.reason
    assert "ttft 2.500s" in d.reason, d.reason
    refused = _route(busy(), slo_ttft_s=2.4)
    assert isinstance(refused, Rejection), refused
    assert "predicted TTFT 2.500s" in refused.reason and refused.retry_after_s >= 1.0
    # With nothing queued there, the same request predicts 0.5 s.
    idle = [_view("d", "decode"), _view("p", "prefill")]
    assert "ttft 0.500s" in _route(idle, slo_ttft_s=0.6).reason


@pytest.mark.timeout(240)
def test_ten_times_overload_admits_what_meets_the_slo_and_refuses_the_rest_at_once(tmp_path):
    args = chaos_overload.parse_args(["--count", "100", "--rate", "10", "--tokens", "530",
                                      "--slo-ms", "5000", "--sim-scale", "1.0",
                                      "--workdir", str(tmp_path)])
    res = chaos_overload.run(args)
    detail = {k: v for k, v in res.items() if k != "config"}
    assert res["other"] == {}, detail  # no 503, no error, no dropped stream
    assert res["admitted"] + res["refused_429"] == 100, detail
    assert res["admitted"] >= 3 and res["refused_429"] >= 50, detail
    assert res["admitted_on_time"] >= 0.9 * res["admitted"], detail
    assert res["refused_with_retry_after"] == res["refused_429"], detail
    assert res["refused_max_s"] < 2.0, detail
    assert not any(res["held_after"].values()), detail
