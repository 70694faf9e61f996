"""A decode worker lost mid-stream: the gateway continues the stream on another.

First against a fake conductor and fake decode workers (real ZeroMQ sockets, one
process), which lets a test say exactly what a lost worker still sends; then with real
processes: a killed decode worker, a killed and restarted one, and none coming back.
"""

from __future__ import annotations

import asyncio
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from common.client import Client, GenerationError
from common.protocol import (
    WORKER_LEAVING,
    Tokens,
)
from common.sampling_params import SamplingParams
from common.zmq_rpc import RpcServer
from services.engine.config import EngineConfig
from services.gateway.backend import BackendUnavailable, GenerationRequest
from services.gateway.cluster_backend import ClusterBackend
from services.gateway.failover import (
    FailoverSettings,
    LostWorkers,
    attempt_id,
    remaining_tokens,
)
from tests.cluster import Cluster, make_served_tiny_model, stream_each
from tests.gateway_fakes import fake_cluster_and_backend, until, worker_status
from tests.tiny_models import random_prompts

pytestmark = pytest.mark.timeout(300)

PROMPT = [5, 6, 7]
SAMPLING = {"max_tokens": 8, "min_tokens": 5, "temperature": 0.0, "seed": 3}


def test_lost_worker_is_avoided_until_the_conductor_has_seen_it_go():
    lost = LostWorkers()
    lost.add("d0", "tcp://a")
    assert lost.exclude(None) == ["d0"]  # the conductor did not answer: keep avoiding
    assert lost.exclude([worker_status("d0", "tcp://a", True)]) == ["d0"]
    assert lost.exclude([worker_status("d0", "tcp://a", False)]) == []
    # Listed alive again after that: a restarted process, which may take the request.
    assert lost.exclude([worker_status("d0", "tcp://a", True)]) == []
    lost.add("d1", "tcp://b")
    assert lost.exclude([worker_status("d1", "tcp://c", True)]) == []  # restarted elsewhere


def test_remaining_tokens_owes_only_the_rest():
    assert remaining_tokens(SAMPLING, 0) == SAMPLING["max_tokens"]
    assert remaining_tokens(SAMPLING, 3) == SAMPLING["max_tokens"] - 3
    assert remaining_tokens(SAMPLING, 99) == 0
    assert attempt_id("r", 0) == "r" and attempt_id("r", 2) == "r.r2"
    with pytest.raises(ValueError):
        FailoverSettings(wait_s=-1)


@pytest.fixture
async def fake():
    async with fake_cluster_and_backend(stall_check_s=0.2) as pair:
        yield pair


async def _collect(backend: ClusterBackend, rid: str, into: list[Tokens]) -> list[Tokens]:
    async for t in backend.generate(GenerationRequest(rid, PROMPT, SAMPLING)):
        into.append(t)
    return into



def _ids(events: list[Tokens]) -> list[int]:
    return [t for e in events for t in e.token_ids]


async def test_lost_worker_stream_continues_on_another_without_mixing(fake):
    cluster, backend = fake
    seen: list[Tokens] = []
    task = asyncio.create_task(_collect(backend, "r", seen))
    _, wire, _ = await cluster.wait_generated(1)
    for pos, tok in enumerate([10, 11, 12]):
        await cluster.send(backend.stream_addr, wire, Tokens(pos, [tok]))
    await until(lambda: len(seen) == 3)
    cluster.alive["d0"] = False  # its heartbeats lapsed
    worker, wire1, gen = await cluster.wait_generated(2)
    assert (worker, wire1) == ("d1", "r.r1")
    assert gen.prompt_token_ids == PROMPT + [10, 11, 12] and gen.start_position == 3
    # The whole request's sampling: the worker counts the streamed tokens as output.
    assert (gen.sampling.max_tokens, gen.sampling.min_tokens, gen.sampling.seed) == (
        SAMPLING["max_tokens"], SAMPLING["min_tokens"], 3)
    # What the lost worker still delivers (position 3 onwards) must not reach the client.
    await cluster.send(backend.stream_addr, wire, Tokens(3, [99, 98]))
    await asyncio.sleep(0.1)
    await cluster.send(backend.stream_addr, wire1, Tokens(3, [13, 14]))
    await cluster.send(backend.stream_addr, wire1, Tokens(5, [15, 16, 17], finished=True,
                                                          finish_reason="length"))
    events = await asyncio.wait_for(task, 10)
    assert _ids(events) == [10, 11, 12, 13, 14, 15, 16, 17]
    assert [e.position for e in events] == [0, 1, 2, 3, 5]
    assert events[-1].finish_reason == "length"
    await until(lambda: ("d0", "r") in cluster.aborted)  # if only frozen, it stops too
    assert ("d1", "r.r1") not in cluster.aborted  # it finished there


async def test_stream_handed_back_by_a_stopping_worker_continues_elsewhere(fake):
    cluster, backend = fake
    seen: list[Tokens] = []
    task = asyncio.create_task(_collect(backend, "h", seen))
    _, wire, _ = await cluster.wait_generated(1)
    await cluster.send(backend.stream_addr, wire, Tokens(0, [10, 11]))
    # d0 stops on purpose: it is still listed alive, yet must not get the request again.
    await cluster.send(backend.stream_addr, wire, Tokens(
        2, [], finished=True, finish_reason="error", error=WORKER_LEAVING))
    worker, wire1, gen = await cluster.wait_generated(2)
    assert (worker, wire1, gen.start_position) == ("d1", "h.r1", 2)
    assert gen.prompt_token_ids == PROMPT + [10, 11]
    await cluster.send(backend.stream_addr, wire1, Tokens(2, [12] * 6, finished=True,
                                                          finish_reason="length"))
    events = await asyncio.wait_for(task, 10)
    assert _ids(events) == [10, 11] + [12] * 6
    assert all(e.error is None for e in events)
    assert ("d0", "h") not in cluster.aborted  # it let go itself


async def test_waits_for_a_worker_to_come_back(fake):
    cluster, backend = fake
    cluster.alive["d1"] = False
    seen: list[Tokens] = []
    task = asyncio.create_task(_collect(backend, "w", seen))
    _, wire, _ = await cluster.wait_generated(1)
    await cluster.send(backend.stream_addr, wire, Tokens(0, [10]))
    await until(lambda: seen)
    cluster.alive["d0"] = False
    await asyncio.sleep(0.8)  # no decode worker at all for a while
    assert len(cluster.generated) == 1 and not task.done()
    cluster.alive["d0"] = True  # restarted under its id (here at its old address)
    worker, wire1, gen = await cluster.wait_generated(2)
    assert (worker, wire1, gen.start_position) == ("d0", "w.r1", 1)
    await cluster.send(backend.stream_addr, wire1, Tokens(1, [11] * 7, finished=True,
                                                          finish_reason="length"))
    events = await asyncio.wait_for(task, 10)
    assert _ids(events) == [10] + [11] * 7


async def test_no_worker_within_the_wait_ends_with_a_clear_error(fake):
    cluster, backend = fake
    seen: list[Tokens] = []
    task = asyncio.create_task(_collect(backend, "e", seen))
    _, wire, _ = await cluster.wait_generated(1)
    await cluster.send(backend.stream_addr, wire, Tokens(0, [10]))
    await until(lambda: seen)
    start = time.monotonic()
    cluster.alive.update(d0=False, d1=False)
    events = await asyncio.wait_for(task, 15)
    assert time.monotonic() - start >= 2.0  # it waited out wait_s
    assert _ids(events) == [10]
    assert events[-1].finished and events[-1].finish_reason == "error"
    assert "no other took the request within 2s" in events[-1].error
    assert "e" not in backend.decoders and not backend.queues


async def test_worker_that_refuses_the_resumed_request_is_passed_over(fake):
    cluster, backend = fake
    cluster.workers["d2"] = RpcServer(cluster.ctx, "tcp://127.0.0.1:*",
                                      cluster._worker("d2"), name="d2")
    await cluster.workers["d2"].start()
    cluster.alive.update(d1=False, d2=True)  # Route prefers d0, then d1, then d2
    cluster.mode["d1"] = "refuse"
    seen: list[Tokens] = []
    task = asyncio.create_task(_collect(backend, "x", seen))
    _, wire, _ = await cluster.wait_generated(1)
    await cluster.send(backend.stream_addr, wire, Tokens(0, [10]))
    await until(lambda: seen)
    cluster.alive.update(d0=False, d1=True)
    assert (await cluster.wait_generated(2))[:2] == ("d1", "x.r1")  # refused there
    worker, wire2, _ = await cluster.wait_generated(3)
    assert (worker, wire2) == ("d2", "x.r2")
    await until(lambda: ("d1", "x.r1") in cluster.aborted)  # it may have admitted it
    await cluster.send(backend.stream_addr, wire2, Tokens(1, [12] * 7, finished=True,
                                                          finish_reason="length"))
    events = await asyncio.wait_for(task, 10)
    assert _ids(events) == [10] + [12] * 7


async def test_new_request_waits_for_a_decode_worker_to_register(fake):
    """Right after a conductor restart no worker is registered yet: the first Route is
    answered ``unavailable``; the request waits for one instead of failing with 503."""
    cluster, backend = fake
    cluster.alive.update(d0=False, d1=False)
    seen: list[Tokens] = []
    task = asyncio.create_task(_collect(backend, "n", seen))
    await until(lambda: cluster.routes >= 3)  # asked, and asked again
    assert not cluster.generated and not task.done()
    cluster.alive["d1"] = True  # a worker said Hello to the conductor
    worker, wire, gen = await cluster.wait_generated(1)
    assert (worker, wire, gen.start_position) == ("d1", "n", 0)  # a first attempt
    assert gen.prompt_token_ids == PROMPT
    await cluster.send(backend.stream_addr, wire, Tokens(0, [20] * 8, finished=True,
                                                         finish_reason="length"))
    events = await asyncio.wait_for(task, 10)
    assert _ids(events) == [20] * 8 and events[-1].finish_reason == "length"
    assert len(cluster.generated) == 1 and not backend.queues and not backend.decoders


async def test_new_request_with_no_decode_worker_within_the_wait_is_unavailable(fake):
    cluster, backend = fake
    cluster.alive.update(d0=False, d1=False)
    start = time.monotonic()
    with pytest.raises(BackendUnavailable, match=r"no live decode .*waited 1.5s"):
        await asyncio.wait_for(_collect(backend, "u", []), 10)
    assert time.monotonic() - start >= 1.4  # it waited out route_wait_s, not at once
    assert cluster.routes >= 5 and not cluster.generated
    assert not backend.queues and not backend.decoders


async def test_no_route_wait_answers_unavailable_at_once(fake):
    cluster, backend = fake
    cluster.alive.update(d0=False, d1=False)
    backend.failover = FailoverSettings(route_wait_s=0)
    with pytest.raises(BackendUnavailable, match="no live decode"):
        await asyncio.wait_for(_collect(backend, "z", []), 5)
    assert cluster.routes == 1


# --- real processes ------------------------------------------------------------------

N = 400  # long enough that a stream is still running when its worker is killed


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_served_tiny_model(tmp_path_factory.mktemp("served") / "tiny")


@pytest.fixture(scope="module")
def prompts():
    return random_prompts([40, 23, 57, 31], vocab=49152, seed=34)


@pytest.fixture(scope="module")
def reference(model_dir, prompts):
    """The undisturbed run. float64 everywhere: recomputing prompt + generated tokens in
    one prefill must give the same argmax as decoding them one by one."""
    from services.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float64",
                                    kv_cache_bytes=64 << 20))
    done = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=N,
                                                   ignore_eos=True))
    return [c.token_ids for c in done]


def _streams(cluster: Cluster, prompts: list[list[int]], started: list[int]):
    return stream_each(cluster, prompts, N, started)


def _wait_started(started: list[int], n: int, futures) -> None:
    deadline = time.monotonic() + 120
    while len(started) < n:
        for f in futures:
            if f.done():
                f.result()  # raises what went wrong
        assert time.monotonic() < deadline, "the streams never started"
        time.sleep(0.01)


def _check_exact(chunks, want: list[int]) -> None:
    ids = [t for c in chunks for t in c.token_ids]
    positions = [c.position for c in chunks]
    assert positions == [sum(len(c.token_ids) for c in chunks[:i])
                         for i in range(len(chunks))], "positions not contiguous"
    assert ids == want
    assert chunks[-1].finish_reason == "length"


def test_killed_decode_worker_streams_continue_exactly(model_dir, tmp_path, prompts,
                                                       reference):
    cluster = Cluster(str(model_dir), tmp_path, ["unified", "unified"], dtype="float64")
    cluster.start()
    try:
        started: list[int] = []
        futures = _streams(cluster, prompts, started)
        _wait_started(started, len(prompts), futures)
        cluster.signal("unified-0", signal.SIGKILL)  # least-loaded gave it some streams
        for f, want in zip(futures, reference, strict=True):
            _check_exact(f.result(timeout=240), want)
        assert "re-routing" in cluster.procs["gateway"].log.read_text()
    finally:
        cluster.stop()


def test_stopped_decode_worker_hands_its_streams_on(model_dir, tmp_path, prompts,
                                                    reference):
    # Without moving the KV (tests/test_kv_migration.py): handed back, recomputed.
    cluster = Cluster(str(model_dir), tmp_path, ["unified", "unified"], dtype="float64",
                      worker_args=["--migrate-on-stop", "false"])
    cluster.start()
    try:
        started: list[int] = []
        futures = _streams(cluster, prompts, started)
        _wait_started(started, len(prompts), futures)
        cluster.signal("unified-0", signal.SIGTERM)  # a planned stop, not a crash
        for f, want in zip(futures, reference, strict=True):
            _check_exact(f.result(timeout=240), want)
        assert cluster.procs["unified-0"].popen.wait(30) == 0
        assert "requests handed back" in cluster.procs["unified-0"].log.read_text()
        # The conductor heard of the stop from the worker, not from missed heartbeats.
        leaving = [line for line in cluster.procs["conductor"].log.read_text().splitlines()
                   if "worker leaving" in line]
        assert len(leaving) == 1 and "unified-0" in leaving[0]
        assert "handed back" in cluster.procs["gateway"].log.read_text()
    finally:
        cluster.stop()


def test_only_decode_worker_killed_and_restarted_stream_completes(model_dir, tmp_path,
                                                                   prompts, reference):
    cluster = Cluster(str(model_dir), tmp_path, ["prefill", "decode"], dtype="float64",
                      gateway_args=["--decode-failover-wait-s", "120"])
    cluster.start()
    try:
        started: list[int] = []
        futures = _streams(cluster, prompts[:2], started)
        _wait_started(started, 2, futures)
        cluster.signal("decode-1", signal.SIGKILL)
        cluster.procs["decode-1"].popen.wait(10)
        deadline = time.monotonic() + 30
        while cluster.conductor_workers()["decode-1"].alive:  # listed dead before it returns
            assert time.monotonic() < deadline, "decode-1 never listed dead"
            time.sleep(0.05)
        cluster.restart_worker("decode-1", "decode")
        for f, want in zip(futures, reference[:2], strict=True):
            _check_exact(f.result(timeout=240), want)
        assert "re-routing" in cluster.procs["gateway"].log.read_text()
    finally:
        cluster.stop()


def test_no_decode_worker_within_the_wait_fails_cleanly(model_dir, tmp_path, prompts):
    cluster = Cluster(str(model_dir), tmp_path, ["unified"],
                      gateway_args=["--decode-failover-wait-s", "3"])
    cluster.start()
    try:
        started: list[int] = []
        futures = _streams(cluster, prompts[:1], started)
        _wait_started(started, 1, futures)
        cluster.signal("unified-0", signal.SIGKILL)
        with pytest.raises(GenerationError, match="no other took the request within 3s"):
            futures[0].result(timeout=120)
        assert "request failed over to no worker" in cluster.procs["gateway"].log.read_text()
    finally:
        cluster.stop()


def test_request_right_after_a_conductor_restart_waits_for_a_worker(model_dir, tmp_path):
    """Sent when the restarted conductor answers but no worker has registered with it
    yet, a request waits for the worker to come back instead of failing with "no live
    decode worker". The worker is held stopped (SIGSTOP) across the restart, so the
    window is there however slowly a loaded host starts the conductor; it resumes once
    the gateway says the request waits."""
    slow_beats = ["--heartbeat-interval-s", "3"]
    cluster = Cluster(str(model_dir), tmp_path, ["unified"], worker_args=slow_beats,
                      conductor_args=slow_beats)
    cluster.start()
    pool = ThreadPoolExecutor(1)
    try:
        cluster.signal("unified-0", signal.SIGSTOP)
        cluster.signal("conductor", signal.SIGKILL)
        cluster.restart("conductor")
        deadline = time.monotonic() + 30
        while True:
            try:
                workers = cluster.conductor_stats(0.5).workers
                break
            except (TimeoutError, KeyError):
                assert time.monotonic() < deadline, "the conductor did not come back"
                time.sleep(0.05)
        assert not any(w.alive for w in workers)  # the window: nobody registered yet

        def generate():
            with Client(cluster.zmq_addr, timeout_s=60) as client:
                return client.generate(prompt_token_ids=PROMPT, max_tokens=4,
                                       temperature=0, ignore_eos=True)

        started = time.monotonic()
        future = pool.submit(generate)
        log = cluster.procs["gateway"].log
        while "waiting for a decode worker" not in log.read_text():
            assert time.monotonic() - started < 5, "the request did not wait"
            assert not future.done(), future.result()
            time.sleep(0.02)
        cluster.signal("unified-0", signal.SIGCONT)
        done = future.result(timeout=60)
        assert done.finish_reason == "length" and len(done.token_ids) == 4
        assert time.monotonic() - started < 5 + 3  # within route_wait_s (+ its answer)
    finally:
        cluster.stop()
        pool.shutdown(wait=False)
