"""Cluster preflight with real processes: a decode worker started with another block size
is refused by the conductor, exits 78 (EX_CONFIG, which the shipped supervisors do not
restart) with the reason in its log, the gateway's /health
names it, and requests go on being served by the workers that agree."""

from __future__ import annotations

import re

import httpx
import pytest

from common.client import Client
from common.service_main import EXIT_CONFIG
from services.engine.sim import sim_token
from services.engine.tokenizer_export import tokenizer_dir_for
from services.engine.weights import DEFAULT_MODEL
from tests.cluster import Cluster

pytestmark = pytest.mark.timeout(180)

GATEWAY = ["--tokenizer-dir", tokenizer_dir_for(DEFAULT_MODEL), "--max-model-len", "8192"]
# The reference is whichever good worker said Hello first.
REASON = re.compile(r"block_size 32 differs from 16 of (prefill-0|decode-1), "
                    r"the first registered worker of the model")


def test_a_decode_worker_of_another_block_size_is_refused_and_the_rest_serve(tmp_path):
    cluster = Cluster(DEFAULT_MODEL, tmp_path, ["prefill", "decode"], executor="sim",
                      sim_profile="smollm2-cpu", kv_cache_mib=1024, disagg_threshold=32,
                      gateway_args=GATEWAY,
                      worker_args=["--sim-time-scale", "0.02", "--heartbeat-interval-s", "0.3"])
    cluster.start(timeout_s=60)
    try:
        good = cluster.worker_args
        cluster.worker_args = [*good, "--block-size", "32"]
        bad = cluster.start_worker("decode-bad", "decode")
        cluster.worker_args = good
        assert bad.popen.wait(timeout=60) == EXIT_CONFIG == 78  # loudly, not retrying
        listed = cluster.conductor_stats()
        assert sorted(w.info.worker_id for w in listed.workers) == ["decode-1", "prefill-0"]
        [refusal] = listed.refused
        assert (refusal.worker_id, refusal.setting) == ("decode-bad", "block_size")
        assert REASON.fullmatch(refusal.reason)
        log = bad.log.read_text(errors="replace")
        assert f"refused by the conductor: {refusal.reason}" in log
        assert f"pdserve decode: error: refused by the conductor: {refusal.reason}" in log
        assert "Traceback" not in log  # an expected end, not a crash

        health = httpx.get(cluster.base_url + "/health", timeout=10)
        assert health.status_code == 200
        assert health.json() == {
            "ready": True, "refused": [{"worker_id": "decode-bad", "reason": refusal.reason}]}

        prompt = list(range(100, 164))  # over the threshold: prefill-0 sends KV to decode-1
        with Client(cluster.zmq_addr, timeout_s=60) as client:
            got = client.generate(prompt_token_ids=prompt, max_tokens=6).token_ids
        ctx, want = list(prompt), []
        for _ in range(6):
            want.append(sim_token(ctx, 49152))
            ctx.append(want[-1])
        assert got == want
        assert cluster.worker_stats("prefill-0").prefills_done == 1
        assert cluster.worker_stats("decode-1").kv_bytes_received > 0
    finally:
        cluster.stop()
