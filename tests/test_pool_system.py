"""The cache pool inside the running system: real pool, conductor, workers and gateway.

A tiny random model with the default model's vocabulary keeps it fast; every output is
compared token for token against the offline engine with no cache at all.
"""

from __future__ import annotations

import signal
import time

import pytest

from common.client import Client
from common.sampling_params import SamplingParams
from services.engine.config import EngineConfig
from tests.cluster import Cluster, make_served_tiny_model
from tests.pool_procs import PoolProc
from tests.tiny_models import random_prompts

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_served_tiny_model(tmp_path_factory.mktemp("served") / "tiny")


@pytest.fixture
def pool(tmp_path):
    proc = PoolProc("pool-0", tmp_path, dram_blocks=4096).start(learn_block_bytes=True)
    yield proc
    proc.stop()


def uncached(model_dir, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    """Greedy tokens from a fresh offline engine: no prefix cache to hit."""
    from services.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_bytes=16 << 20))
    return engine.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens,
                                                    ignore_eos=True))[0].token_ids


def generate(cluster: Cluster, prompt: list[int], max_tokens: int = MAX_TOKENS):
    with Client(cluster.zmq_addr, timeout_s=60) as client:
        done = client.generate(prompt_token_ids=prompt, max_tokens=max_tokens,
                               temperature=0, ignore_eos=True)
    return done.token_ids, done.usage.cached_tokens


def wait_for(what: str, check, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def test_prefix_computed_on_prefill_a_is_reused_by_b_through_the_pool(model_dir, tmp_path,
                                                                       pool):
    # Round robin sends the first remote prefill to prefill-0, the second to prefill-1.
    cluster = Cluster(str(model_dir), tmp_path, ["prefill", "prefill", "decode"],
                      policy="round_robin", worker_args=["--cache-pools", pool.control])
    cluster.start()
    try:
        for name in ("prefill-0", "prefill-1", "decode-2"):
            wait_for(f"{name} to find the pool",
                     lambda n=name: cluster.worker_stats(n).pool.instances == ["pool-0"])
        shared, tail_a, tail_b = random_prompts([96, 11, 7], vocab=49152, seed=61)
        first = shared + tail_a  # six full blocks, a partial seventh
        assert generate(cluster, first)[0] == uncached(model_dir, first)
        written = wait_for("the write-back", lambda: (
            cluster.worker_stats("prefill-0").pool.written_blocks == 6
            and pool.stats().dram_blocks == 6))
        assert written

        second = shared + tail_b
        tokens, cached = generate(cluster, second)
        assert tokens == uncached(model_dir, second)
        b = cluster.worker_stats("prefill-1")
        assert b.prefills_done == 1 and b.pool.fetches == 1
        assert b.pool.fetched_blocks == 6  # the whole shared prefix, 96 tokens
        assert cached == 96
        a = cluster.worker_stats("prefill-0")
        assert a.prefills_done == 1 and a.pool.fetched_blocks == 0
        # prefill-1 finds its six blocks already pooled and writes back none of them.
        time.sleep(0.5)
        assert cluster.worker_stats("prefill-1").pool.written_blocks == 0
        assert pool.stats().dram_blocks == 6
    finally:
        cluster.stop()


def test_a_fully_pooled_prompt_is_loaded_by_the_worker_that_decodes_it(model_dir, tmp_path,
                                                                       pool):
    # Two unified workers, alternated: the second never computed the prompt itself.
    cluster = Cluster(str(model_dir), tmp_path, ["unified", "unified"], policy="round_robin",
                      worker_args=["--cache-pools", pool.control])
    cluster.start()
    try:
        for name in ("unified-0", "unified-1"):
            wait_for(f"{name} to find the pool",
                     lambda n=name: cluster.worker_stats(n).pool.instances == ["pool-0"])
        prompt = random_prompts([81], vocab=49152, seed=62)[0]  # five full blocks + 1
        want = uncached(model_dir, prompt)
        assert generate(cluster, prompt) == (want, 0)
        wait_for("the write-back",
                 lambda: cluster.worker_stats("unified-0").pool.written_blocks == 5)
        assert generate(cluster, prompt) == (want, 80)  # only the last token computed
        s = cluster.worker_stats("unified-1")
        assert s.pool.fetched_blocks == 5 and s.pool.written_blocks == 0
        assert 0 < s.pool.fetch_seconds < 2 and 0 < s.pool.adopt_seconds < 2
        a = cluster.worker_stats("unified-0")  # computed, never fetched: no time counted
        assert a.pool.fetch_seconds == a.pool.adopt_seconds == 0
    finally:
        cluster.stop()


def test_a_pool_that_is_down_costs_nothing_but_the_hit(model_dir, tmp_path, pool):
    cluster = Cluster(str(model_dir), tmp_path, ["unified"],
                      worker_args=["--cache-pools", pool.control, "--pool-timeout-s", "0.5"])
    cluster.start()
    try:
        wait_for("the pool", lambda: cluster.worker_stats("unified-0").pool.instances)
        pool.stop()
        prompt = random_prompts([70], vocab=49152, seed=63)[0]
        assert generate(cluster, prompt) == (uncached(model_dir, prompt), 0)
        s = cluster.worker_stats("unified-0")
        assert s.pool.fetched_blocks == 0 and s.num_requests == 0
    finally:
        cluster.stop()


def test_multi_turn_follow_up_moves_only_the_blocks_decode_lacks(model_dir, tmp_path):
    cluster = Cluster(str(model_dir), tmp_path, ["prefill", "decode"])
    cluster.start()
    try:
        turn1 = random_prompts([70], vocab=49152, seed=64)[0]  # 4 full blocks + 6 tokens
        answer, _ = generate(cluster, turn1, max_tokens=24)
        assert answer == uncached(model_dir, turn1, 24)
        sent1 = cluster.worker_stats("prefill-0").kv_bytes_sent
        got1 = cluster.worker_stats("decode-1").kv_bytes_received
        assert sent1 == got1 > 0
        per_block = got1 // 5  # the whole prompt's five blocks moved
        assert got1 == 5 * per_block

        # Turn two: the conversation so far plus a new message. Decode computed 93 of
        # its 94 tokens (the last answer token's KV is never needed): five full blocks.
        turn2 = turn1 + answer + random_prompts([20], vocab=49152, seed=65)[0]  # 114
        tokens, cached = generate(cluster, turn2)
        assert tokens == uncached(model_dir, turn2)
        assert cached == 80
        moved = cluster.worker_stats("decode-1").kv_bytes_received - got1
        assert moved == cluster.worker_stats("prefill-0").kv_bytes_sent - sent1
        assert moved == 3 * per_block  # blocks 5, 6 and the partial 7 of 8
    finally:
        cluster.stop()


def test_fully_pooled_prompt_is_routed_to_decode_alone_and_loaded_there(model_dir, tmp_path,
                                                                        pool):
    # Cache-aware routing with the pool in the conductor's index: once every block of a
    # prompt but its last token is pooled and no worker holds it, loading the blocks on
    # the decode worker beats any remote prefill, so no prefill worker is involved.
    pools = ["--cache-pools", pool.control]
    cluster = Cluster(str(model_dir), tmp_path, ["prefill", "decode"], policy="cache_aware",
                      conductor_args=pools, worker_args=pools)
    cluster.start()
    try:
        prompt = random_prompts([161], vocab=49152, seed=66)[0]  # ten full blocks + 1
        want = uncached(model_dir, prompt)
        assert generate(cluster, prompt) == (want, 0)
        wait_for("the pool's blocks in the conductor's index", lambda: cluster.conductor_stats()
                 .index_locations.get("pool:pool-0", 0) == 10)
        # Fresh workers under the same names: no local copy of the prompt anywhere.
        for name, role in (("prefill-0", "prefill"), ("decode-1", "decode")):
            cluster.procs[name].popen.kill()
            cluster.procs[name].popen.wait(10)
            cluster.start_worker(name, role)
        cluster.wait_ready(60)
        for name in ("prefill-0", "decode-1"):
            wait_for(f"{name} to find the pool",
                     lambda n=name: cluster.worker_stats(n).pool.instances == ["pool-0"])
        time.sleep(1.2)  # a heartbeat: the conductor sees both fresh workers idle
        assert generate(cluster, prompt) == (want, 160)
        assert cluster.worker_stats("prefill-0").prefills_done == 0
        s = cluster.worker_stats("decode-1")
        assert s.pool.fetched_blocks == 10 and s.kv_bytes_received == 0
    finally:
        cluster.stop()


def test_replicated_blocks_survive_a_pool_instance_dying(model_dir, tmp_path):
    a = PoolProc("pool-0", tmp_path, dram_blocks=4096).start(learn_block_bytes=True)
    b = PoolProc("pool-1", tmp_path, dram_blocks=4096).start(learn_block_bytes=True)
    cluster = Cluster(str(model_dir), tmp_path, ["unified", "unified"], policy="round_robin",
                      worker_args=["--cache-pools", f"{a.control},{b.control}",
                                   "--pool-replicas", "2", "--pool-timeout-s", "0.5"])
    cluster.start()
    try:
        for name in ("unified-0", "unified-1"):
            wait_for(f"{name} to find both pools", lambda n=name: cluster.worker_stats(n)
                     .pool.instances == ["pool-0", "pool-1"])
        prompt = random_prompts([81], vocab=49152, seed=67)[0]
        want = uncached(model_dir, prompt)
        assert generate(cluster, prompt) == (want, 0)
        wait_for("both copies", lambda: a.stats().dram_blocks == b.stats().dram_blocks
                 == 5)
        a.stop(signal.SIGKILL)
        assert generate(cluster, prompt) == (want, 80)  # every block from pool-1
        assert cluster.worker_stats("unified-1").pool.fetched_blocks == 5
    finally:
        cluster.stop()
        a.stop(signal.SIGKILL)
        b.stop()
