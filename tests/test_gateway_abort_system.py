"""Abandoned requests end on the workers: real gateway, conductor, prefill and decode
processes (simulated workers, so a long greedy request costs no CPU). However a client
lets go of a request (HTTP disconnect, streaming or not; the SDK's abort; the gateway's
own timeout), the decode and prefill workers' free blocks return to their start value
and nothing is left running within a few seconds, though max_tokens would keep the
decode worker busy for a minute. A request id two clients share is two requests."""

from __future__ import annotations

import time

import httpx
import pytest
import zmq

from common.client import Client
from common.protocol import Abort, ClientRequest, Error, decode, encode
from services.engine.tokenizer_export import tokenizer_dir_for
from services.engine.weights import DEFAULT_MODEL
from tests.cluster import Cluster, stats
from tests.tiny_models import random_prompts

pytestmark = pytest.mark.timeout(240)

LONG = 6000  # decode steps of ~10 ms: a minute of work if nobody stops it
WORKERS = ("prefill-0", "decode-1")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    gateway = ["--tokenizer-dir", tokenizer_dir_for(DEFAULT_MODEL), "--max-model-len", "8192"]
    c = Cluster(DEFAULT_MODEL, tmp_path_factory.mktemp("abort"), ["prefill", "decode"],
                executor="sim", sim_profile="smollm2-cpu", kv_cache_mib=1024,
                worker_args=["--sim-time-scale", "0.25", "--heartbeat-interval-s", "0.3"],
                gateway_args=gateway)
    yield c.start(timeout_s=90)
    c.stop()


@pytest.fixture(scope="module")
def prompt():
    return random_prompts([200], vocab=49152, seed=3)[0]  # over the threshold: remote prefill


def _snapshot(cluster: Cluster) -> dict[str, int]:
    return {n: stats(cluster.procs[n].control).free_blocks for n in WORKERS}


def _wait_running(cluster: Cluster, within_s: float = 20.0) -> None:
    deadline = time.monotonic() + within_s
    while stats(cluster.procs["decode-1"].control).running == 0:
        if time.monotonic() > deadline:
            raise AssertionError("the request never started decoding")
        time.sleep(0.05)


def _assert_freed(cluster: Cluster, start: dict[str, int], within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while True:
        now = {n: stats(cluster.procs[n].control) for n in WORKERS}
        if all(s.free_blocks == start[n] and s.running == 0 and s.waiting == 0
               for n, s in now.items()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not freed within {within_s} s: start {start}, now "
                                 + str({n: (s.free_blocks, s.running, s.waiting)
                                        for n, s in now.items()}))
        time.sleep(0.1)


def _http_stream_disconnect(cluster: Cluster, prompt: list[int]) -> None:
    body = {"model": DEFAULT_MODEL, "prompt": prompt, "max_tokens": LONG, "stream": True,
            "temperature": 0}
    with httpx.Client(timeout=60) as http, \
            http.stream("POST", cluster.base_url + "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        assert next(line for line in lines if line).startswith("data: ")
        _wait_running(cluster)


def _http_disconnect(cluster: Cluster, prompt: list[int]) -> None:
    body = {"model": DEFAULT_MODEL, "prompt": prompt, "max_tokens": LONG, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(cluster.base_url + "/v1/completions", json=body, timeout=3)


def _sdk_abort(cluster: Cluster, prompt: list[int]) -> None:
    with Client(cluster.zmq_addr, timeout_s=60) as client:
        stream = client.stream(prompt_token_ids=prompt, max_tokens=LONG, temperature=0)
        next(stream)
        _wait_running(cluster)
        stream.close()  # the SDK sends Abort


def _gateway_timeout(cluster: Cluster, prompt: list[int]) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(cluster.zmq_addr)
    try:
        req = ClientRequest(model="", sampling={"max_tokens": LONG, "temperature": 0},
                            prompt_token_ids=prompt, timeout_s=2.0)
        sock.send_multipart(encode(req, request_id="times-out"))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # no Abort from here: the gateway must stop it
            assert sock.poll(30_000)
            rec = decode(sock.recv_multipart()).record
            if isinstance(rec, Error):
                assert rec.code == "timeout"
                return
        raise AssertionError("no timeout error")
    finally:
        sock.close(0)
        ctx.term()


@pytest.mark.parametrize("let_go", [_http_stream_disconnect, _http_disconnect, _sdk_abort,
                                    _gateway_timeout], ids=lambda f: f.__name__.strip("_"))
def test_abandoned_request_frees_the_workers_at_once(cluster, prompt, let_go):
    start = _snapshot(cluster)
    let_go(cluster, prompt)
    _assert_freed(cluster, start)


def test_a_request_id_two_clients_share_is_two_requests(cluster, prompt):
    start = _snapshot(cluster)
    body = {"model": DEFAULT_MODEL, "prompt": prompt, "max_tokens": LONG, "stream": True,
            "temperature": 0}
    headers = {"X-Request-Id": "shared"}
    with httpx.Client(timeout=60) as http, \
            http.stream("POST", cluster.base_url + "/v1/completions", json=body,
                        headers=headers) as resp:
        assert resp.status_code == 200 and resp.headers["x-request-id"] == "shared"
        lines = (line for line in resp.iter_lines() if line)
        next(lines)
        _wait_running(cluster)
        short = {**body, "max_tokens": 5, "stream": False}
        other = httpx.post(cluster.base_url + "/v1/completions", json=short, headers=headers,
                           timeout=60)
        assert other.status_code == 200, other.text
        assert other.json()["id"] == "shared"
        assert other.json()["usage"]["completion_tokens"] == 5
        with Client(cluster.zmq_addr, timeout_s=60) as client:
            done = client.generate(prompt_token_ids=prompt, max_tokens=5, temperature=0,
                                   request_id="shared")
        assert done.finish_reason == "length" and len(done.token_ids) == 5
        got = [next(lines) for _ in range(5)]  # the first request still streams
        assert all(line.startswith("data: {") for line in got)
    _assert_freed(cluster, start)


def test_abort_during_a_remote_prefill_frees_both_workers(cluster):
    long_prompt = random_prompts([4000], vocab=49152, seed=4)[0]  # seconds of prefill
    start = _snapshot(cluster)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(cluster.zmq_addr)
    try:
        req = ClientRequest(model="", sampling={"max_tokens": 4000, "temperature": 0},
                            prompt_token_ids=long_prompt)
        sock.send_multipart(encode(req, request_id="mid-prefill"))
        deadline = time.monotonic() + 20
        while stats(cluster.procs["prefill-0"].control).prefill_jobs == 0:
            assert time.monotonic() < deadline, "the prefill never started"
            time.sleep(0.05)
        sock.send_multipart(encode(Abort(), request_id="mid-prefill"))
        _assert_freed(cluster, start)
    finally:
        sock.close(0)
        ctx.term()
