"""Simulated workers (``--executor sim``) as real processes behind the real gateway and
conductor: deterministic tokens end to end over both prefill paths, the conductor's
cost model fed by their heartbeats, and SLO rejection as HTTP 429 with Retry-After."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from common.client import Client
from services.engine.sim import sim_token
from services.engine.tokenizer_export import tokenizer_dir_for
from services.engine.weights import DEFAULT_MODEL
from tests.cluster import Cluster
from tests.tiny_models import random_prompts

pytestmark = pytest.mark.timeout(180)

GATEWAY = ["--tokenizer-dir", tokenizer_dir_for(DEFAULT_MODEL), "--max-model-len", "8192"]


def expected(prompt: list[int], n: int) -> list[int]:
    out, ctx = [], list(prompt)
    for _ in range(n):
        out.append(sim_token(ctx, 49152))
        ctx.append(out[-1])
    return out


def sim_cluster(tmp_path, roles, **kw) -> Cluster:
    kw.setdefault("sim_profile", "smollm2-cpu")
    kw.setdefault("kv_cache_mib", 1024)  # simulated: only the blocks written take memory
    kw.setdefault("worker_args", ["--sim-time-scale", "0.02", "--heartbeat-interval-s", "0.3"])
    return Cluster(DEFAULT_MODEL, tmp_path, roles, executor="sim", gateway_args=GATEWAY, **kw)


def test_sim_cluster_serves_deterministic_tokens_over_both_prefill_paths(tmp_path):
    cluster = sim_cluster(tmp_path, ["prefill", "decode", "decode"], disagg_threshold=64)
    cluster.start(timeout_s=60)
    try:
        prompts = random_prompts([10, 40, 63, 64, 200, 700, 1500, 90, 20, 300, 1000, 5],
                                 vocab=49152, seed=5)

        def one(prompt):
            with Client(cluster.zmq_addr, timeout_s=60) as client:
                return client.generate(prompt_token_ids=prompt, max_tokens=20,
                                       temperature=0.7).token_ids
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            got = list(pool.map(one, prompts))
        assert got == [expected(p, 20) for p in prompts]
        resp = httpx.post(cluster.base_url + "/v1/completions", timeout=60, json={
            "model": DEFAULT_MODEL, "prompt": prompts[6], "max_tokens": 8})
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 8
        remote = sum(len(p) >= 64 for p in prompts) + 1
        stats = {n: cluster.worker_stats(n) for n in ("prefill-0", "decode-1", "decode-2")}
        assert stats["prefill-0"].prefills_done == remote
        assert stats["decode-1"].kv_bytes_received > 0
        assert stats["decode-2"].kv_bytes_received > 0
        assert stats["decode-1"].local_fallbacks == stats["decode-2"].local_fallbacks == 0
        time.sleep(0.8)  # a heartbeat or two carries the step timings to the conductor
        prefill_obs, decode_obs = cluster.conductor_stats().cost_observations
        assert prefill_obs >= 1 and decode_obs >= 10
    finally:
        cluster.stop()


def test_cache_aware_conductor_rejects_an_impossible_slo_with_429(tmp_path):
    # The conductor predicts with the smollm2-cpu calibration: no prompt prefills in 1 ms.
    cluster = sim_cluster(tmp_path, ["prefill", "decode"], policy="cache_aware",
                          conductor_args=["--slo-ttft-ms", "1"])
    cluster.start(timeout_s=60)
    try:
        body = {"model": DEFAULT_MODEL, "prompt": list(range(100, 400)), "max_tokens": 4}
        resp = httpx.post(cluster.base_url + "/v1/completions", json=body, timeout=30)
        assert resp.status_code == 429, resp.text
        assert int(resp.headers["Retry-After"]) >= 1
        err = resp.json()["error"]
        assert err["code"] == "overloaded" and "predicted TTFT" in err["message"]
        # The request's own target overrides the default: admitted, served.
        ok = httpx.post(cluster.base_url + "/v1/completions", timeout=30,
                        json={**body, "slo_ttft_ms": 60_000})
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["completion_tokens"] == 4
        bad = httpx.post(cluster.base_url + "/v1/completions", timeout=30,
                         json={**body, "slo_tbt_ms": -5})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "slo_tbt_ms"
        with Client(cluster.zmq_addr, timeout_s=30) as client:
            got = client.generate(prompt_token_ids=body["prompt"], max_tokens=4,
                                  slo_ttft_ms=60_000)
        assert got.token_ids == expected(body["prompt"], 4)
        log = cluster.procs["conductor"].log.read_text()
        assert "rejected" in log and "routed" in log
        # The gateway hashed the prompt's 18 full blocks with the workers' KV layout.
        assert "hit 0/18 blocks" in log
    finally:
        cluster.stop()
