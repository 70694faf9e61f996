"""The whole system as real processes on localhost: gateway, conductor, prefill, decode.

A tiny random model with the default model's vocabulary and tokenizer keeps it fast;
outputs are compared token for token against the offline engine on the same weights.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import signal
import socket
import time

import httpx
import pytest

from common.client import Client, GenerationError
from common.sampling_params import SamplingParams
from services.engine.config import EngineConfig
from tests.cluster import Cluster, dealer, make_served_tiny_model
from tests.tiny_models import random_prompts

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_served_tiny_model(tmp_path_factory.mktemp("served") / "tiny")


@pytest.fixture(scope="module")
def disagg(model_dir, tmp_path_factory):
    cluster = Cluster(str(model_dir), tmp_path_factory.mktemp("disagg"), ["prefill", "decode"])
    yield cluster.start()
    cluster.stop()


@pytest.fixture(scope="module")
def colocated(model_dir, tmp_path_factory):
    cluster = Cluster(str(model_dir), tmp_path_factory.mktemp("colo"), ["unified"])
    yield cluster.start()
    cluster.stop()


@pytest.fixture(scope="module")
def prompts():
    return random_prompts([3, 17, 40, 64, 90, 120, 9, 33, 55, 77, 18, 26, 130, 48, 70, 100],
                          vocab=49152, seed=21)


@pytest.fixture(scope="module")
def offline(model_dir, prompts):
    from services.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_bytes=64 << 20))
    done = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                   ignore_eos=True))
    return [c.token_ids for c in done]


def sdk_tokens(cluster: Cluster, prompts: list[list[int]]) -> list[list[int]]:
    def one(prompt):
        with Client(cluster.zmq_addr, timeout_s=120) as client:
            return client.generate(prompt_token_ids=prompt, max_tokens=MAX_TOKENS,
                                   temperature=0, ignore_eos=True).token_ids
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        return list(pool.map(one, prompts))


def wait_idle(cluster: Cluster, names: list[str], timeout_s: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = {n: cluster.worker_stats(n) for n in names}
        if all(s.num_requests == 0 and s.free_blocks == s.info.num_blocks
               for s in stats.values()):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"workers not idle: {stats}")
        time.sleep(0.1)


def test_disaggregated_equals_colocated_equals_offline(disagg, colocated, prompts, offline):
    before = disagg.worker_stats("prefill-0")
    got_disagg = sdk_tokens(disagg, prompts)
    got_colo = sdk_tokens(colocated, prompts)
    assert got_disagg == offline
    assert got_colo == offline
    stats = wait_idle(disagg, ["prefill-0", "decode-1"])
    # Prompts of >= 16 tokens went through the prefill worker: their KV crossed over.
    remote = sum(len(p) >= disagg.disagg_threshold for p in prompts)
    assert stats["prefill-0"].prefills_done - before.prefills_done == remote
    assert stats["decode-1"].kv_bytes_received > 0
    assert stats["decode-1"].local_fallbacks == 0


def test_streaming_positions_in_order_first_token_from_prefill(disagg, prompts, offline):
    before = disagg.worker_stats("prefill-0").prefills_done
    with Client(disagg.zmq_addr, timeout_s=60) as client:
        chunks = list(client.stream(prompt_token_ids=prompts[5], max_tokens=MAX_TOKENS,
                                    temperature=0, ignore_eos=True))
    positions = [c.position for c in chunks if c.token_ids]
    ids = [t for c in chunks for t in c.token_ids]
    assert ids == offline[5]
    assert positions == sorted(positions) and positions[0] == 0
    assert chunks[-1].finished and chunks[-1].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert disagg.worker_stats("prefill-0").prefills_done == before + 1


def test_openai_client_chat_and_completions(disagg):
    from openai import OpenAI

    client = OpenAI(base_url=disagg.base_url + "/v1", api_key="none")
    model = disagg.model
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say something."}],
        max_tokens=8, temperature=0)
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert 1 <= chat.usage.completion_tokens <= 8
    streamed = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say something."}],
        max_tokens=8, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == chat.choices[0].message.content
    comp = client.completions.create(model=model, prompt="Once upon a time", max_tokens=10,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert comp.usage.completion_tokens == 10
    pieces = client.completions.create(model=model, prompt="Once upon a time", max_tokens=10,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in pieces) == comp.choices[0].text
    assert [m.id for m in client.models.list().data] == [model]


def test_sdk_abort_and_client_disconnect_free_blocks(disagg, prompts):
    with Client(disagg.zmq_addr, timeout_s=60) as client:
        stream = client.stream(prompt_token_ids=prompts[12], max_tokens=500, ignore_eos=True)
        got = [next(stream) for _ in range(3)]
        assert [c.position for c in got if c.token_ids][:1] == [0]
        stream.close()  # abandons the request: the SDK sends Abort
    wait_idle(disagg, ["prefill-0", "decode-1"])
    body = {"model": disagg.model, "prompt": prompts[13], "max_tokens": 500,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http, \
            http.stream("POST", disagg.base_url + "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        seen = [line for line, _ in zip(lines, range(4), strict=False) if line]
        assert seen and seen[0].startswith("data: ")
    wait_idle(disagg, ["prefill-0", "decode-1"])


@pytest.mark.parametrize("body, status", [
    ("{not json", 400),
    ({"model": "M", "prompt": "hi", "max_tokens": "ten"}, 400),
    ({"model": "other-model", "prompt": "hi"}, 404),
    ({"model": "M", "prompt": [5] * 1024}, 400),
    ({"model": "M", "prompt": "hi", "max_tokens": 5000}, 400),
])
def test_bad_http_input_gets_openai_errors(disagg, body, status):
    if isinstance(body, dict) and body["model"] == "M":
        body = {**body, "model": disagg.model}
    data = body if isinstance(body, str) else json.dumps(body)
    resp = httpx.post(disagg.base_url + "/v1/completions", content=data,
                      headers={"Content-Type": "application/json"}, timeout=30)
    assert resp.status_code == status
    err = resp.json()["error"]
    assert err["message"] and "type" in err
    assert_still_serving(disagg)


def assert_still_serving(cluster: Cluster, within_s: float = 30.0) -> None:
    """A good request is answered 200 within ``within_s``. A 503 while a loaded machine
    delays a heartbeat is asked again; a process the bad input took down never answers."""
    deadline, refused = time.monotonic() + within_s, []
    while True:
        ok = httpx.post(cluster.base_url + "/v1/completions", timeout=30, json={
            "model": cluster.model, "prompt": "hello", "max_tokens": 2, "ignore_eos": True})
        if ok.status_code != 503 or time.monotonic() > deadline:
            break
        refused.append(ok.text)
        time.sleep(1.0)
    assert ok.status_code == 200, (ok.text, refused)
    assert ok.json()["usage"]["completion_tokens"] == 2


def test_malformed_frames_get_error_replies_and_processes_keep_serving(disagg, prompts):
    import zmq

    from common.protocol import decode

    ctx = zmq.Context.instance()
    targets = [(disagg.conductor_addr, "conductor"), (disagg.procs["prefill-0"].control, "worker"),
               (disagg.procs["decode-1"].control, "worker"), (disagg.zmq_addr, "")]
    for addr, server in targets:  # the client port is open to all; the others need a key
        sock = dealer(ctx, addr, server=server, keys_dir=disagg.keys_dir if server else "")
        for garbage in ([b"\xc1\xff\x00"], [b"\x81\xa1v\x01"]):
            sock.send_multipart(garbage)
            assert sock.poll(5000), f"no reply from {addr}"
            reply = decode(sock.recv_multipart()).record
            assert type(reply).__name__ == "Error" and reply.code == "malformed"
        sock.close(0)
    assert sdk_tokens(disagg, prompts[:2])[0]  # still serving


@pytest.mark.parametrize("change, problem", [
    ({"lease_s": float("nan")}, "lease_s must be in"),
    ({"lease_s": 1e308}, "lease_s must be in"),
    ({"kv_addr": "bogus://x", "kv_advert": None}, "kv_addr: not a transfer address"),
    ({"kv_token": b"t" * 65}, "kv_token must be at most 64 bytes"),
    ({"block_ids": [1, -2]}, "block_ids must be integers"),
    ({"skip_blocks": 3}, "skip_blocks must be in [0, 2]"),
])
def test_a_prefill_that_lies_is_a_bad_request_and_takes_nothing(disagg, change, problem):
    """What a decode worker sends a prefill worker, with one value no decode worker
    would send: "bad_request" naming it, before the prefill worker takes anything."""
    import zmq

    from common.protocol import Prefill, decode, encode
    from common.zmq_auth import CurveKeys

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    keys = CurveKeys.load(disagg.keys_dir, "decode")  # the peer a prefill worker serves
    sock.curve_serverkey = keys.server_key("worker")
    sock.curve_publickey, sock.curve_secretkey = keys.own.public, keys.own.secret
    sock.connect(disagg.procs["prefill-0"].control)
    try:
        fields = dict(prompt_token_ids=[5, 6, 7], sampling=SamplingParams(max_tokens=1),
                      stream_addr="tcp://127.0.0.1:9", kv_addr="tcp://127.0.0.1:9",
                      block_ids=[1, 2], skip_blocks=0, lease_s=5.0, decode_id="decode-1",
                      kv_token=b"k" * 16)
        sock.send_multipart(encode(Prefill(**{**fields, **change}), request_id="liar"))
        assert sock.poll(10_000)
        reply = decode(sock.recv_multipart()).record
        assert type(reply).__name__ == "Error" and reply.code == "bad_request"
        assert problem in reply.message
    finally:
        sock.close(0)
    assert disagg.worker_stats("prefill-0").num_requests == 0
    assert_still_serving(disagg)


def test_sdk_errors_are_clear(disagg):
    with Client(disagg.zmq_addr, timeout_s=30) as client, \
            pytest.raises(GenerationError, match="max_tokens"):
        client.generate("hello", max_tokens=0)


def test_kv_lease_expiry_falls_back_to_local_prefill(model_dir, tmp_path, prompts, offline):
    cluster = Cluster(str(model_dir), tmp_path, ["prefill", "decode"], kv_lease_s=1.5)
    cluster.start()
    try:
        cluster.signal("prefill-0", signal.SIGSTOP)  # alive to the OS, silent to everyone
        start = time.monotonic()
        got = sdk_tokens(cluster, [prompts[4]])
        assert got == [offline[4]]
        assert time.monotonic() - start < 1.5 + 5
        assert cluster.worker_stats("decode-1").local_fallbacks == 1
        cluster.signal("prefill-0", signal.SIGCONT)
        wait_idle(cluster, ["decode-1"])
    finally:
        cluster.stop()


def test_killed_worker_is_marked_dead_and_routed_around(model_dir, tmp_path, prompts, offline):
    cluster = Cluster(str(model_dir), tmp_path, ["unified", "unified"])
    cluster.start()
    try:
        cluster.procs["unified-0"].popen.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        while cluster.conductor_workers()["unified-0"].alive:
            assert time.monotonic() - killed < 3.0 + 2.0, "not marked dead in time"
            time.sleep(0.05)
        assert sdk_tokens(cluster, prompts[:6]) == offline[:6]
        assert cluster.conductor_workers()["unified-1"].alive
    finally:
        cluster.stop()


@pytest.mark.slow
def test_default_model_over_http_answers_paris(tmp_path):
    from services.engine.weights import DEFAULT_MODEL

    cluster = Cluster(DEFAULT_MODEL, tmp_path, ["prefill", "decode"], kv_cache_mib=256)
    cluster.start(timeout_s=240)
    try:
        resp = httpx.post(cluster.base_url + "/v1/chat/completions", timeout=120, json={
            "model": DEFAULT_MODEL, "temperature": 0, "max_tokens": 24,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        assert resp.status_code == 200, resp.text
        assert "Paris" in resp.json()["choices"][0]["message"]["content"]
        assert cluster.worker_stats("prefill-0").prefills_done == 1  # 37 tokens >= 16
    finally:
        cluster.stop()


def test_decode_worker_death_mid_stream_continues_on_another(model_dir, tmp_path):
    from services.engine.engine import LLMEngine

    prompt = random_prompts([40], vocab=49152, seed=33)[0]
    n = 600
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float64",
                                    kv_cache_bytes=64 << 20))
    want = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=n,
                                                    ignore_eos=True))[0].token_ids
    cluster = Cluster(str(model_dir), tmp_path, ["unified", "unified"], dtype="float64")
    cluster.start()
    try:
        with Client(cluster.zmq_addr, timeout_s=60) as client:
            stream = client.stream(prompt_token_ids=prompt, max_tokens=n, temperature=0,
                                   ignore_eos=True)
            chunks = [next(stream)]
            # Both workers idle: least-loaded breaks the tie by id, so unified-0 has it.
            cluster.signal("unified-0", signal.SIGSTOP)
            cluster.signal("unified-0", signal.SIGKILL)
            chunks += list(stream)
        ids = [t for c in chunks for t in c.token_ids]
        assert len(ids) == n and ids == want
        assert chunks[-1].finish_reason == "length"
        assert "re-routing" in cluster.procs["gateway"].log.read_text()
    finally:
        cluster.stop()


def test_async_sdk_chat_and_completion_streams(disagg, prompts, offline, model_dir):
    import asyncio

    from common.client import AsyncClient

    async def run():
        async with AsyncClient(disagg.zmq_addr, timeout_s=60) as client:
            chat = await client.generate(
                messages=[{"role": "user", "content": "Say something."}], max_tokens=6,
                temperature=0, ignore_eos=True)
            pieces = [c async for c in client.stream(prompt_token_ids=prompts[7],
                                                     max_tokens=MAX_TOKENS, temperature=0,
                                                     ignore_eos=True)]
            both = await asyncio.gather(*[client.generate(
                prompt_token_ids=p, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
                for p in prompts[8:10]])
            return chat, pieces, both

    chat, pieces, both = asyncio.run(run())
    assert len(chat.token_ids) == 6 and chat.usage.completion_tokens == 6
    from common.tokenizer import TextTokenizer

    assert chat.text == TextTokenizer.from_dir(model_dir).decode(chat.token_ids)
    assert [t for c in pieces for t in c.token_ids] == offline[7]
    assert [c.token_ids for c in both] == offline[8:10]


def test_sdk_and_gateway_import_without_torch():
    import subprocess
    import sys

    code = ("import sys, common.client, services.gateway.server, services.gateway.openai_api; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def _ucx_importable() -> bool:
    from common.transfer import available_backends

    return "ucx" in available_backends()


@pytest.mark.parametrize("backend", [
    "tcp", "shm",
    pytest.param("ucx", marks=pytest.mark.skipif(not _ucx_importable(),
                                                 reason="ucxx-cu12 is not installed")),
])
def test_each_backend_forced_gives_colocated_output(backend, model_dir, tmp_path, prompts,
                                                    offline):
    cluster = Cluster(str(model_dir), tmp_path, ["prefill", "decode"],
                      worker_args=["--transfer-backend", backend])
    cluster.start()
    try:
        chosen = prompts[2:6]
        assert sdk_tokens(cluster, chosen) == offline[2:6]
        stats = wait_idle(cluster, ["prefill-0", "decode-1"])
        remote = sum(len(p) >= cluster.disagg_threshold for p in chosen)
        assert stats["prefill-0"].transfer_backends == {backend: remote}
        assert stats["decode-1"].kv_bytes_received > 0
        assert stats["decode-1"].local_fallbacks == 0
    finally:
        cluster.stop()


@pytest.mark.parametrize("advertise_host", ["127.0.0.1", ""])
def test_wildcard_binds_advertise_a_dialable_host(advertise_host, model_dir, tmp_path,
                                                  prompts, offline):
    # The KV listener binds every interface; peers are told a host they can dial: the
    # configured one, else this machine's own address.
    cluster = Cluster(str(model_dir), tmp_path, ["prefill", "decode"],
                      worker_args=["--transfer-backend", "tcp", "--kv-host", "0.0.0.0",
                                   "--advertise-host", advertise_host])
    cluster.start()
    try:
        assert sdk_tokens(cluster, prompts[2:4]) == offline[2:4]
        decode = cluster.worker_stats("decode-1")
        host = advertise_host or socket.gethostbyname(socket.gethostname())
        assert decode.kv_advert.endpoints["tcp"].startswith(f"tcp://{host}:")
        assert decode.info.kv_addr.startswith(f"tcp://{host}:")
        assert decode.kv_bytes_received > 0 and decode.local_fallbacks == 0
    finally:
        cluster.stop()


def test_advertised_addresses():
    from services.worker.server import advertise

    assert advertise("tcp://0.0.0.0:5", "10.0.0.7") == "tcp://10.0.0.7:5"
    assert advertise("ucx://10.1.1.1:9", "") == "ucx://10.1.1.1:9"
    assert advertise("tcp://*:5", "") == f"tcp://{socket.gethostbyname(socket.gethostname())}:5"
    assert advertise("shm://pdserve-1/ctl", "10.0.0.7") == "shm://pdserve-1/ctl"


def test_auto_negotiation_picks_shared_memory_on_one_host(disagg, prompts):
    stats = disagg.worker_stats("decode-1")
    assert set(stats.kv_advert.endpoints) >= {"shm", "tcp"}
    sdk_tokens(disagg, [prompts[4]])  # 90 tokens: prefilled remotely
    used = disagg.worker_stats("prefill-0").transfer_backends
    assert set(used) == {"shm"} and used["shm"] >= 1


def test_conductor_restart_rebuilds_the_prefix_index(model_dir, tmp_path):
    cluster = Cluster(str(model_dir), tmp_path, ["decode", "decode"], policy="cache_aware")
    cluster.start()

    def cached_tokens(prompt) -> int:
        with Client(cluster.zmq_addr, timeout_s=60) as client:
            done = client.generate(prompt_token_ids=prompt, max_tokens=4, temperature=0,
                                   ignore_eos=True)
        return done.usage.cached_tokens

    try:
        prompt = random_prompts([300], vocab=49152, seed=44)[0]
        assert cached_tokens(prompt) == 0
        time.sleep(1.5)  # a heartbeat clears the first request's in-flight load estimate
        deadline = time.monotonic() + 5
        while cluster.conductor_stats().index_blocks < 300 // 16:
            assert time.monotonic() < deadline, "KV events never reached the index"
            time.sleep(0.1)
        assert cached_tokens(prompt + [5]) == 288  # routed to the worker holding it
        # Kill the conductor; a new one on the same addresses must learn it all back.
        cluster.signal("conductor", signal.SIGKILL)
        cluster.procs["conductor"].popen.wait(10)
        restarted = time.monotonic()
        cluster.start_conductor()
        while True:
            try:
                s = cluster.conductor_stats(1)
                if s.index_blocks >= 300 // 16 and sum(w.alive for w in s.workers) == 2:
                    break
            except (TimeoutError, KeyError):
                pass
            assert time.monotonic() - restarted < 10, "index not rebuilt within 10 s"
            time.sleep(0.1)
        # Cache-aware again: each follow-up goes where the prefix is. (Spaced by a
        # heartbeat: between heartbeats the decode choice weighs in-flight load first.)
        hits = []
        for i in range(3):
            hits.append(cached_tokens(prompt + [6 + i]))
            time.sleep(1.2)
        assert hits == [288] * 3
    finally:
        cluster.stop()


@pytest.mark.slow
def test_prefill_killed_mid_transfer_decode_recovers_at_once(tmp_path):
    from services.engine.weights import DEFAULT_MODEL

    # A lease far longer than the run: finishing well inside it proves the broken
    # transfer was noticed when the sender died, not when the lease ran out.
    cluster = Cluster(DEFAULT_MODEL, tmp_path, ["prefill", "decode"], kv_cache_mib=256,
                      kv_lease_s=60)
    cluster.start(timeout_s=240)
    try:
        prompt = random_prompts([1500], vocab=49152, seed=55)[0]
        result = {}

        def run():
            with Client(cluster.zmq_addr, timeout_s=120) as client:
                result["done"] = client.generate(prompt_token_ids=prompt, max_tokens=4,
                                                 temperature=0, ignore_eos=True)

        start = time.monotonic()
        worker = concurrent.futures.ThreadPoolExecutor(1).submit(run)
        while cluster.worker_stats("decode-1").kv_bytes_received == 0:
            assert time.monotonic() - start < 60, "no KV ever arrived"
            time.sleep(0.01)
        cluster.signal("prefill-0", signal.SIGKILL)  # layers are still streaming
        worker.result(timeout=120)
        assert time.monotonic() - start < 45
        assert len(result["done"].token_ids) == 4
        stats = wait_idle(cluster, ["decode-1"])["decode-1"]
        assert stats.local_fallbacks == 1 and stats.live_transfers == 0
        assert "sender connection lost" in cluster.procs["decode-1"].log.read_text()
    finally:
        cluster.stop()


@pytest.mark.slow
def test_decode_killed_mid_transfer_prefill_frees_all_and_request_completes(tmp_path):
    from services.engine.engine import LLMEngine
    from services.engine.weights import DEFAULT_MODEL

    prompt = random_prompts([1500], vocab=49152, seed=56)[0]
    # Chunks of 512 tokens: the step that streams the layers (the last 476 tokens) ends
    # about a second after the kill, well before the gateway gives up on decode-1.
    want = LLMEngine(EngineConfig(model=DEFAULT_MODEL, kv_cache_bytes=256 << 20,
                                  max_num_batched_tokens=512)).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].token_ids
    # The lease is far longer than the run: the prefill worker must free what it held
    # because the receiver died, not because the lease ran out.
    cluster = Cluster(DEFAULT_MODEL, tmp_path, ["prefill", "decode", "decode"],
                      kv_cache_mib=256, kv_lease_s=60,
                      worker_args=["--max-num-batched-tokens", "512"])
    cluster.start(timeout_s=240)
    try:
        idle = cluster.worker_stats("prefill-0")
        result = {}

        def run():
            with Client(cluster.zmq_addr, timeout_s=120) as client:
                result["done"] = client.generate(prompt_token_ids=prompt, max_tokens=4,
                                                 temperature=0, ignore_eos=True)

        start = time.monotonic()
        worker = concurrent.futures.ThreadPoolExecutor(1).submit(run)
        while (sending := cluster.worker_stats("prefill-0")).kv_bytes_sent == 0:
            assert time.monotonic() - start < 60, "no KV was ever sent"
            time.sleep(0.01)
        receiving = [n for n in ("decode-1", "decode-2")
                     if cluster.worker_stats(n).live_transfers]
        assert len(receiving) == 1, "the transfer was over before the kill"
        cluster.signal(receiving[0], signal.SIGKILL)  # layers are still streaming to it
        other = ({"decode-1", "decode-2"} - set(receiving)).pop()
        assert sending.prefill_jobs == 1
        worker.result(timeout=150)
        assert result["done"].token_ids == want
        # The survivor gave everything back, well inside the lease.
        prefill = wait_idle(cluster, ["prefill-0"], timeout_s=30)["prefill-0"]
        assert time.monotonic() - start < 60
        assert prefill.free_blocks == idle.free_blocks == prefill.info.num_blocks
        assert prefill.prefill_jobs == 0 and prefill.live_transfers == 0
        assert "prefill failed" in cluster.procs["prefill-0"].log.read_text()
        all_layers = -(-len(prompt) // 16) * 16 * 46080  # whole blocks, 30 layers
        # The gateway moved the request to the other decode worker. Which way it went
        # depends on one race, decided by the machine's load: whether the prefill
        # worker's step (it streams token 0) ended before the gateway gave decode-1 up.
        gateway_log = cluster.procs["gateway"].log.read_text()
        resumed_at = re.findall(r"re-routing.*?tokens_so_far=(\d+)", gateway_log)
        assert resumed_at in (["0"], ["1"]), resumed_at
        decode = wait_idle(cluster, [other])[other]
        assert decode.live_transfers == 0
        if resumed_at == ["1"]:
            # Token 0 was out: the other worker resumed at position 1 and prefilled
            # the request itself, and the failed prefill was never done.
            assert prefill.prefills_done == idle.prefills_done
            assert 0 < prefill.kv_bytes_sent - idle.kv_bytes_sent < all_layers
            assert decode.kv_bytes_received == 0
        else:
            # Nothing was out: the request started over through the prefill worker,
            # which did it once (the failed attempt is not counted) and sent the
            # other worker every layer; the attempt cut short sent some layers.
            assert prefill.prefills_done == idle.prefills_done + 1
            assert decode.kv_bytes_received == all_layers
            assert all_layers < prefill.kv_bytes_sent - idle.kv_bytes_sent < 2 * all_layers
    finally:
        cluster.stop()
