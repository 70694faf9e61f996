"""Tensor-parallel workers among real processes: a prefix a TP=2 worker wrote to the cache
pool is fetched by a TP=1 worker and continued exactly; a TP=2 worker whose follower rank
is SIGKILLed mid-stream is reported dead, its streams finish on another worker exactly,
and none of its processes is left.

The served tiny model (2 layers, 4 query and 2 KV heads of 16, float64, 16-token blocks)
splits two ways; float64 keeps TP=2's all-reduced sums on TP=1's greedy path."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from common.client import Client
from common.sampling_params import SamplingParams
from services.engine.config import EngineConfig
from tests.cluster import Cluster, Host, make_served_tiny_model, stream_each
from tests.pool_procs import PoolProc
from tests.tiny_models import random_prompts

pytestmark = pytest.mark.timeout(240)

TP2 = Host(env={"PDSERVE_TENSOR_PARALLEL_SIZE": "2"})
# One block in the all-heads layout: layers x K|V x tokens x KV heads x head_dim x 8 B.
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 8
HEARTBEAT_S = 1.0  # the conductor's and workers' default interval
DEAD_AFTER_S = 3 * HEARTBEAT_S  # services/conductor/registry.py: three missed
POOLED_TOKENS = 12
STREAMED_TOKENS = 160  # enough that the streams still run when the follower dies


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_served_tiny_model(tmp_path_factory.mktemp("served") / "tiny")


@pytest.fixture(scope="module")
def prompts():
    """Two prompts sharing six full blocks (the pool test), and three to stream."""
    shared, tail_a, tail_b, *streamed = random_prompts([96, 11, 7, 40, 23, 57], vocab=49152,
                                                       seed=151)
    return [shared + tail_a, shared + tail_b], streamed


@pytest.fixture(scope="module")
def want(model_dir, prompts):
    """Greedy tokens of one colocated TP=1 engine with no cache to hit, all prompts in
    one run (its steps are those of the longest output)."""
    from services.engine.engine import LLMEngine

    pooled, streamed = prompts
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float64",
                                    kv_cache_bytes=64 << 20))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for n in [POOLED_TOKENS] * len(pooled) + [STREAMED_TOKENS] * len(streamed)]
    done = [c.token_ids for c in engine.generate(pooled + streamed, params)]
    return done[:len(pooled)], done[len(pooled):]


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    proc = PoolProc("pool-0", tmp_path_factory.mktemp("tp-pool"), dram_blocks=4096)
    proc.start(learn_block_bytes=True)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def cluster(model_dir, pool, tmp_path_factory):
    """unified-0 with two ranks, unified-1 with one, and a cache pool. Round robin over
    the sorted ids sends the first request of each pair to unified-0. The tests share
    it (starting one costs most of a test's time); the follower test, which ends
    unified-0, runs last."""
    cluster = Cluster(str(model_dir), pool.workdir, ["unified", "unified"], dtype="float64",
                      policy="round_robin", worker_args=["--cache-pools", pool.control],
                      worker_hosts={"unified-0": TP2})
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def wait_for(what: str, check, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def children(pid: int) -> list[int]:
    """Child pids of ``pid``, over all its threads (followers are started from the
    engine thread, and listed under it)."""
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
            for c in (task / "children").read_text().split()]


def gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.split(")")[-1].split()[0] == "Z"  # exited, not yet reaped


def token_ids(chunks) -> list[int]:
    """The stream's tokens, after checking its positions run on with no gap or repeat."""
    at = 0
    for c in chunks:
        assert c.position == at, "positions not contiguous"
        at += len(c.token_ids)
    assert chunks[-1].finish_reason == "length"
    return [t for c in chunks for t in c.token_ids]


def test_prefix_pooled_by_tp2_is_fetched_and_continued_by_tp1(cluster, pool, prompts, want):
    (first, second), (want_first, want_second) = prompts[0], want[0]
    for name in ("unified-0", "unified-1"):
        wait_for(f"{name} to find the pool",
                 lambda n=name: cluster.worker_stats(n).pool.instances == ["pool-0"])
    assert cluster.conductor_workers()["unified-0"].info.tp_size == 2
    with Client(cluster.zmq_addr, timeout_s=60) as client:
        a = client.generate(prompt_token_ids=first, max_tokens=POOLED_TOKENS,
                            temperature=0, ignore_eos=True)
        assert a.token_ids == want_first and a.usage.cached_tokens == 0
        wait_for("the TP=2 worker's write-back", lambda: (
            cluster.worker_stats("unified-0").pool.written_blocks == 6
            and pool.stats().dram_blocks == 6))
        # Stored in the all-heads layout, not one rank's half of it.
        assert pool.stats().block_bytes == BLOCK_BYTES
        assert pool.stats().dram_bytes == 6 * BLOCK_BYTES

        b = client.generate(prompt_token_ids=second, max_tokens=POOLED_TOKENS,
                            temperature=0, ignore_eos=True)
    assert b.token_ids == want_second
    assert b.usage.cached_tokens == 96
    tp1 = cluster.worker_stats("unified-1")
    assert tp1.pool.fetches == 1 and tp1.pool.fetched_blocks == 6
    assert tp1.pool.written_blocks == 0  # all six were pooled already
    assert cluster.worker_stats("unified-0").pool.fetched_blocks == 0
    assert pool.stats().dram_hits == 6 and pool.stats().dram_blocks == 6


def test_follower_killed_mid_stream_worker_dead_streams_rerouted_nothing_left(
        cluster, prompts, want):
    streamed, want_streamed = prompts[1], want[1]
    rank0 = cluster.procs["unified-0"].popen
    followers = children(rank0.pid)
    assert len(followers) == 1, followers
    # Three streams in turn: two on unified-0 (TP=2), one on unified-1.
    started: list[int] = []
    futures = stream_each(cluster, streamed, STREAMED_TOKENS, started, timeout_s=180)
    wait_for("every stream's first tokens", lambda: len(started) == len(streamed)
             or any(f.done() and f.exception() for f in futures), timeout_s=60)
    assert len(started) == len(streamed), [f.exception() for f in futures]

    killed = time.monotonic()
    os.kill(followers[0], signal.SIGKILL)
    # Rank 0 exits on its own (non-zero): its heartbeats stop with it.
    code = rank0.wait(30)
    exited = time.monotonic()
    assert code != 0
    wait_for("the conductor to list unified-0 dead",
             lambda: not cluster.conductor_workers()["unified-0"].alive,
             timeout_s=DEAD_AFTER_S + 10)
    dead = time.monotonic()
    # Three missed heartbeats after the last one, which came before the exit; the
    # slack is the conductor's check period and polling on a loaded machine.
    assert dead - exited <= DEAD_AFTER_S + 3.0, (dead - exited, exited - killed)

    assert [token_ids(f.result(timeout=180)) for f in futures] == want_streamed
    gateway = cluster.procs["gateway"].log.read_text()
    lost = [line for line in gateway.splitlines() if "decode worker lost, re-routing" in line]
    assert len(lost) == 2 and all("worker_id=unified-0" in line for line in lost), lost
    log = cluster.procs["unified-0"].log.read_text(errors="replace")
    assert "tensor-parallel engine is dead" in log and "rank 1" in log, log[-3000:]
    assert "engine step failed" not in log  # no request was ended with an error
    assert gone(rank0.pid) and all(gone(p) for p in followers)
    assert cluster.conductor_workers()["unified-1"].alive
