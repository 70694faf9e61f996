"""Disaggregated serving between tensor-parallel sizes, over real processes: prefill TP=1
feeds decode TP=2, prefill TP=2 feeds decode TP=2 and TP=1. The output equals one TP=1
engine computing alone, and the KV bytes moved equal the model's KV for each prompt:
every head's slice once, none twice. Each sending rank sends each receiving rank the
heads it holds (the direct path), on tcp, ucx and shm; a decode follower that refuses its
slices makes the worker prefill the prompt itself, exactly, leaving no transfer behind.

One cluster serves every case: between cases one worker is replaced by one of another
TP size or backend (the conductor routes to whichever prefill and decode worker is up),
so each case costs a worker start, not a cluster's."""

from __future__ import annotations

import time

import pytest

from common.client import Client
from common.sampling_params import SamplingParams
from services.engine.config import EngineConfig
from services.engine.tp_recv import FAIL_ENV
from tests.cluster import Cluster, Host, make_served_tiny_model
from tests.tiny_models import random_prompts
from tests.ucx_probe import UCX_MISSING

pytestmark = pytest.mark.timeout(240)

MAX_TOKENS = 6
# The served tiny model: 2 layers, 2 KV heads of 16, float64, 16-token blocks.
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 8
TP2 = {"PDSERVE_TENSOR_PARALLEL_SIZE": "2"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_served_tiny_model(tmp_path_factory.mktemp("served") / "tiny")


CASES = [(1, 2, "tcp"), (2, 2, "tcp"), (2, 2, "ucx"), (2, 1, "shm")]


@pytest.fixture(scope="module")
def prompts_and_want(model_dir):
    """Prompts over the disaggregation threshold, two per case (none a prefix a worker
    cached in an earlier case), and what TP=1 alone makes of them."""
    from services.engine.engine import LLMEngine

    keys = ["refuse", "again", *CASES]
    prompts = random_prompts([45, 70] * len(keys), vocab=49152, seed=71)
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float64",
                                    kv_cache_bytes=16 << 20))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [c.token_ids for c in engine.generate(prompts, params)]
    return {k: (prompts[2 * i:2 * i + 2], want[2 * i:2 * i + 2]) for i, k in enumerate(keys)}


class Workers:
    """The cluster's one prefill and one decode worker, each replaced on demand."""

    def __init__(self, cluster: Cluster, current: dict[str, tuple[str, dict]]) -> None:
        self.cluster = cluster
        self.current = current  # role -> (worker name, its environment)
        self.starts = 0

    def use(self, role: str, env: dict) -> str:
        name, now = self.current[role]
        if now == env:
            return name
        # The old worker stops (it tells the conductor it is leaving) while the new one
        # starts: no request is in flight between cases.
        cluster = self.cluster
        old = cluster.procs.pop(name)
        old.popen.terminate()
        self.starts += 1
        new = f"{role}-{self.starts}"
        cluster.worker_hosts[new] = Host(env=env)
        cluster.start_worker(new, role)
        old.popen.wait(30)
        deadline = time.monotonic() + 30
        while (w := cluster.conductor_workers().get(name)) is not None and w.alive:
            assert time.monotonic() < deadline, f"{name} still listed alive"
            time.sleep(0.2)
        cluster.wait_alive(new)
        name = new
        self.current[role] = (name, env)
        return name


@pytest.fixture(scope="module")
def workers(model_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("cluster")
    switch = workdir / "refuse"  # FAIL_ENV: which decode rank refuses its slices
    switch.write_text("")
    start = {"prefill": ("prefill-0", {}),
             "decode": ("decode-1", {**TP2, "PDSERVE_TRANSFER_BACKEND": "tcp",
                                     FAIL_ENV: str(switch)})}
    cluster = Cluster(str(model_dir), workdir, ["prefill", "decode"], dtype="float64",
                      kv_lease_s=5.0,
                      worker_hosts={n: Host(env=e) for n, e in start.values()})
    cluster.start()
    try:
        yield Workers(cluster, start), switch
    finally:
        cluster.stop()


def generate(cluster: Cluster, prompts) -> list[list[int]]:
    with Client(cluster.zmq_addr, timeout_s=60) as client:
        return [client.generate(prompt_token_ids=p, max_tokens=MAX_TOKENS, temperature=0,
                                ignore_eos=True).token_ids for p in prompts]


def counters(cluster: Cluster, prefill: str, decode: str) -> dict:
    p, d = cluster.worker_stats(prefill), cluster.worker_stats(decode)
    return {"prefills": p.prefills_done, "sent": p.kv_bytes_sent,
            "received": d.kv_bytes_received, "fallbacks": d.local_fallbacks,
            "live": d.live_transfers, **{f"path {k}": v for k, v in p.kv_send_paths.items()},
            **{f"backend {k}": v for k, v in p.transfer_backends.items()}}


def delta(before: dict, after: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def test_a_follower_refusing_its_slices_makes_the_worker_prefill_itself(
        workers, prompts_and_want):
    """Decode rank 1 refuses every slice (the test-only switch): rank 0 hears of it
    through the group's store, drops the other ranks' part, gives the blocks back and
    prefills the prompt here; the output is still exact, no transfer stays live, and
    every process of the cluster keeps running."""
    workers, switch = workers
    prompts, want = prompts_and_want["refuse"]
    prefill = workers.use("prefill", {})
    decode = workers.use("decode", {**TP2, "PDSERVE_TRANSFER_BACKEND": "tcp",
                                    FAIL_ENV: str(switch)})
    cluster = workers.cluster
    before = counters(cluster, prefill, decode)
    switch.write_text("1")
    try:
        got = generate(cluster, prompts)
    finally:
        switch.write_text("")
    assert got == want
    changed = delta(before, counters(cluster, prefill, decode))
    assert changed["fallbacks"] == 2 and "live" not in changed
    assert cluster.worker_stats(decode).live_transfers == 0
    assert cluster.worker_stats(decode).waiting_for_kv == 0
    assert all(p.popen.poll() is None for p in cluster.procs.values())
    # And it serves from prefill again once the switch is off.
    prompts, want = prompts_and_want["again"]
    before = counters(cluster, prefill, decode)
    assert generate(cluster, prompts) == want
    assert delta(before, counters(cluster, prefill, decode))["prefills"] == 2


@pytest.mark.parametrize(("prefill_tp", "decode_tp", "backend"), [
    pytest.param(*case, marks=pytest.mark.skipif(case[2] == "ucx" and UCX_MISSING is not None,
                                                 reason=f"{UCX_MISSING}"))
    for case in CASES])
def test_prefill_and_decode_of_different_tp_sizes(workers, prompts_and_want, prefill_tp,
                                                  decode_tp, backend):
    workers, switch = workers
    prompts, want = prompts_and_want[prefill_tp, decode_tp, backend]
    decode_env = {**(TP2 if decode_tp == 2 else {}), "PDSERVE_TRANSFER_BACKEND": backend}
    if decode_tp == 2 and backend == "tcp":
        decode_env[FAIL_ENV] = str(switch)  # the cluster's first decode worker
    prefill = workers.use("prefill", TP2 if prefill_tp == 2 else {})
    decode = workers.use("decode", decode_env)
    cluster = workers.cluster
    before = counters(cluster, prefill, decode)
    assert generate(cluster, prompts) == want
    kv = sum(-(-len(p) // 16) for p in prompts) * BLOCK_BYTES
    # Each sending rank sent each receiving rank the heads it holds, on the backend
    # the decode worker offers, every byte once.
    assert delta(before, counters(cluster, prefill, decode)) == {
        "prefills": 2, "sent": kv, "received": kv, "path direct": 2, f"backend {backend}": 2}
    ranks = cluster.worker_stats(decode).kv_advert.ranks
    assert [(r.head_start, r.head_count) for r in ranks] == (
        [(0, 1), (1, 1)] if decode_tp == 2 else [])
    assert len({r.endpoints[backend] for r in ranks}) == len(ranks)
    listed = cluster.conductor_workers()
    assert (listed[prefill].info.tp_size, listed[decode].info.tp_size) == (prefill_tp,
                                                                           decode_tp)
