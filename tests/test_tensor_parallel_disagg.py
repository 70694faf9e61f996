"""Disaggregated serving between tensor-parallel sizes, over real processes: prefill TP=2
feeds decode TP=1, and prefill TP=1 feeds decode TP=2. The output equals one TP=1 engine
computing alone, and the KV bytes moved equal the model's KV for each prompt: every
head's slice once, none twice. A TP=2 prefill worker's ranks each send their heads'
slice straight to the TP=1 decode worker (the direct path), on tcp and on shm."""

from __future__ import annotations

import pytest

from common.client import Client
from common.sampling_params import SamplingParams
from services.engine.config import EngineConfig
from tests.cluster import Cluster, Host, make_served_tiny_model
from tests.tiny_models import random_prompts

pytestmark = pytest.mark.timeout(240)

MAX_TOKENS = 10
# The served tiny model: 2 layers, 2 KV heads of 16, float64, 16-token blocks.
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 8
TP2 = {"PDSERVE_TENSOR_PARALLEL_SIZE": "2"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_served_tiny_model(tmp_path_factory.mktemp("served") / "tiny")


@pytest.fixture(scope="module")
def prompts_and_want(model_dir):
    """Prompts over the disaggregation threshold, and what TP=1 alone makes of them."""
    from services.engine.engine import LLMEngine

    prompts = random_prompts([45, 70], vocab=49152, seed=71)
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float64",
                                    kv_cache_bytes=16 << 20))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return prompts, [c.token_ids for c in engine.generate(prompts, params)]


@pytest.mark.parametrize(("tp_worker", "backend"), [
    ("prefill-0", "tcp"), ("prefill-0", "shm"), ("decode-1", "tcp"), ("both", "shm")])
def test_prefill_and_decode_of_different_tp_sizes(model_dir, tmp_path, prompts_and_want,
                                                  tp_worker, backend):
    prompts, want = prompts_and_want
    data_plane = {"PDSERVE_TRANSFER_BACKEND": backend}
    tp_of = {w: TP2 if tp_worker in (w, "both") else {} for w in ("prefill-0", "decode-1")}
    cluster = Cluster(str(model_dir), tmp_path, ["prefill", "decode"], dtype="float64",
                      worker_hosts={w: Host(env={**tp, **data_plane})
                                    for w, tp in tp_of.items()})
    cluster.start()
    try:
        with Client(cluster.zmq_addr, timeout_s=60) as client:
            got = [client.generate(prompt_token_ids=p, max_tokens=MAX_TOKENS, temperature=0,
                                   ignore_eos=True).token_ids for p in prompts]
        assert got == want
        kv = sum(-(-len(p) // 16) for p in prompts) * BLOCK_BYTES
        prefill, decode = cluster.worker_stats("prefill-0"), cluster.worker_stats("decode-1")
        assert prefill.prefills_done == 2 and decode.local_fallbacks == 0
        assert prefill.kv_bytes_sent == decode.kv_bytes_received == kv
        # Each sending rank sent each receiving rank the heads it holds, on the backend
        # asked: TP=2 decode lists a receiver per rank, each holding one head.
        assert prefill.kv_send_paths == {"direct": 2}
        assert prefill.transfer_backends == {backend: 2}
        ranks = decode.kv_advert.ranks
        assert [(r.head_start, r.head_count) for r in ranks] == (
            [(0, 1), (1, 1)] if tp_worker != "prefill-0" else [])
        assert len({r.endpoints[backend] for r in ranks}) == len(ranks)
        workers = cluster.conductor_workers()
        assert {w: workers[w].info.tp_size for w in tp_of} == {
            w: 2 if tp else 1 for w, tp in tp_of.items()}
    finally:
        cluster.stop()
