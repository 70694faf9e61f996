"""A decode worker stopped on purpose (SIGTERM) moves its running requests, KV and all,
to another decode worker: real processes, long greedy streams. Every stream equals the
undisturbed run, nothing is recomputed (the receiver counts what it adopted, the gateway
re-routes nothing), and the KV blocks return to where they started on both workers."""

from __future__ import annotations

import re
import signal
import time

import pytest

from common.sampling_params import SamplingParams
from services.engine.config import EngineConfig
from tests.cluster import Cluster, make_served_tiny_model
from tests.test_decode_failover import _check_exact, _streams, _wait_started
from tests.tiny_models import random_prompts

pytestmark = pytest.mark.timeout(300)

N = 400  # test_decode_failover's length: the streams still run when the stop comes


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_served_tiny_model(tmp_path_factory.mktemp("served") / "tiny")


@pytest.fixture(scope="module")
def prompts():
    return random_prompts([40, 23, 57], vocab=49152, seed=35)


@pytest.fixture(scope="module")
def reference(model_dir, prompts):
    """The undisturbed run (float64, as the workers run)."""
    from services.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float64",
                                    kv_cache_bytes=64 << 20))
    done = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=N,
                                                   ignore_eos=True))
    return [c.token_ids for c in done]


def _until(cond, within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_stopped_decode_worker_moves_its_streams_with_their_kv(model_dir, tmp_path,
                                                                 prompts, reference):
    cluster = Cluster(str(model_dir), tmp_path, ["unified", "unified"], dtype="float64")
    cluster.start()
    try:
        start = {n: cluster.worker_stats(n).free_blocks for n in ("unified-0", "unified-1")}
        started: list[int] = []
        futures = _streams(cluster, prompts, started)
        _wait_started(started, len(prompts), futures)
        on_0 = cluster.worker_stats("unified-0").running
        assert on_0 >= 1, "least-loaded routing gave unified-0 no stream"
        cluster.signal("unified-0", signal.SIGTERM)
        for f, want in zip(futures, reference, strict=True):
            _check_exact(f.result(timeout=240), want)
        assert cluster.procs["unified-0"].popen.wait(30) == 0
        log0 = cluster.procs["unified-0"].log.read_text()
        moved = int(re.search(r"moved_with_kv=(\d+)", log0).group(1))
        handed = int(re.search(r"requests handed back.*?requests=(\d+)", log0).group(1))
        # Every stream there was decoding (each had its first token): all of them move.
        assert moved == on_0 and handed == 0
        # The stopping worker freed everything before it exited.
        assert f"free_blocks={start['unified-0']}" in log0
        assert "left_in_engine=0" in log0
        after = cluster.worker_stats("unified-1")
        assert after.kv_migrated_in == moved  # adopted, not recomputed
        gateway = cluster.procs["gateway"].log.read_text()
        assert gateway.count("stream moved with its KV") == moved
        assert "re-routing" not in gateway  # nothing was recomputed elsewhere
        _until(lambda: cluster.worker_stats("unified-1").free_blocks == start["unified-1"],
               30, "the receiving worker's blocks did not all come back")
        assert cluster.worker_stats("unified-1").num_requests == 0
    finally:
        cluster.stop()


def test_alone_a_stopping_worker_hands_its_streams_back(model_dir, tmp_path, prompts,
                                                        reference):
    """No other decode worker to move to: the streams are handed back, and continue
    (recomputed) on a worker started afterwards; nothing is lost."""
    cluster = Cluster(str(model_dir), tmp_path, ["unified"], dtype="float64",
                      gateway_args=["--decode-failover-wait-s", "120"])
    cluster.start()
    try:
        started: list[int] = []
        futures = _streams(cluster, prompts[:1], started)
        _wait_started(started, 1, futures)
        cluster.signal("unified-0", signal.SIGTERM)
        assert cluster.procs["unified-0"].popen.wait(30) == 0
        log0 = cluster.procs["unified-0"].log.read_text()
        assert re.search(r"requests handed back.*requests=1", log0)
        assert "moved_with_kv=0" in log0
        cluster.restart_worker("unified-0", "unified")
        _check_exact(futures[0].result(timeout=240), reference[0])
        assert "handed back" in cluster.procs["gateway"].log.read_text()
    finally:
        cluster.stop()
