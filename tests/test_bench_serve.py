"""bench/serve.py against a fake OpenAI-compatible server with known timings, and its
request builders on tiny inputs."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import statistics
import threading
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web

from bench.datasets import (
    RequestSpec,
    block_tokens,
    poisson_arrivals,
    random_requests,
    shared_prefix_requests,
    trace_requests,
)
from bench.serve import (
    endpoint_url,
    main,
    parse_args,
    prompt_text,
    run_benchmark,
    sse_data,
)
from bench.serve_report import RequestResult, Slo, results_duration, summarize

REAL_TRACE = Path("/work/shared/traces/mooncake_conversation_trace.jsonl")
FIRST_DELAY_S = 0.05
GAP_S = 0.01
SUMMARY_KEYS = {
    "num_requests", "completed", "failed", "errors", "duration_s", "total_input_tokens",
    "total_output_tokens", "request_throughput", "output_throughput",
    "total_token_throughput", "goodput", "goodput_fraction", "slo_ttft_ms", "slo_tpot_ms",
    "output_len_mismatch",
} | {f"{s}_{m}_ms" for s in ("mean", "p50", "p90", "p99")
     for m in ("ttft", "tpot", "itl", "e2e")}


class FakeServer:
    """A streaming OpenAI-compatible server on a thread and event loop of its own.

    Each request waits ``FIRST_DELAY_S``, then streams ``max_tokens`` one-token chunks
    ``GAP_S`` apart, then a usage chunk (unless ``usage=False``) and ``[DONE]``. Chat
    streams open with a role-only chunk before the delay. A body missing any field the
    benchmark must send gets a 400. ``reject(body)`` returning a message turns the
    request into a 400 with that message; ``break_at`` tokens into the stream an error
    event replaces the rest.
    """

    def __init__(self, usage: bool = True, reject=None, break_at: int | None = None):
        self.usage = usage
        self.reject = reject
        self.break_at = break_at
        self.bodies: list[dict] = []
        self.in_flight = 0
        self.peak_in_flight = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fake-openai",
                                        daemon=True)

    def __enter__(self) -> FakeServer:
        self._thread.start()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        app = web.Application()
        app.router.add_post("/v1/completions", self._handle)
        app.router.add_post("/v1/chat/completions", self._handle)
        self._runner = web.AppRunner(app)
        asyncio.run_coroutine_threadsafe(self._start(sock), self._loop).result(timeout=10)
        return self

    async def _start(self, sock: socket.socket) -> None:
        await self._runner.setup()
        await web.SockSite(self._runner, sock).start()

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    @staticmethod
    def _malformed(body: dict, chat: bool) -> str | None:
        if not (body.get("stream") is True and body.get("ignore_eos") is True
                and body.get("temperature") == 0
                and body.get("stream_options") == {"include_usage": True}
                and isinstance(body.get("max_tokens"), int) and body["max_tokens"] >= 1
                and body.get("model") == "fake"):
            return "missing or wrong sampling fields"
        if chat:
            msgs = body.get("messages")
            if not (isinstance(msgs, list) and msgs and isinstance(msgs[0].get("content"), str)):
                return "chat needs messages"
        elif not (isinstance(body.get("prompt"), list)
                  and all(isinstance(t, int) for t in body["prompt"])):
            return "prompt must be a list of token ids"
        return None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        chat = request.path.endswith("/chat/completions")
        body = await request.json()
        self.bodies.append(body)
        problem = self._malformed(body, chat) or (self.reject and self.reject(body))
        if problem:
            return web.json_response({"error": {"message": problem, "code": 400}}, status=400)
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            return await self._stream(request, body, chat)
        finally:
            self.in_flight -= 1

    async def _stream(self, request: web.Request, body: dict, chat: bool):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(obj) -> None:
            data = obj if isinstance(obj, str) else json.dumps(obj)
            await resp.write(f"data: {data}\n\n".encode())

        if chat:
            await send({"choices": [{"index": 0, "delta": {"role": "assistant",
                                                           "content": ""}}]})
        await asyncio.sleep(FIRST_DELAY_S)
        n = body["max_tokens"]
        for k in range(n):
            if k:
                await asyncio.sleep(GAP_S)
            if k == self.break_at:
                await send({"error": {"message": "engine died", "code": 500}})
                return resp
            piece = f" t{k}"
            choice = {"index": 0, "delta": {"content": piece}} if chat else \
                {"index": 0, "text": piece}
            await send({"choices": [choice]})
        if self.usage:
            prompt_tokens = (len(body["messages"][0]["content"].split()) if chat
                             else len(body["prompt"]))
            await send({"choices": [], "usage": {"prompt_tokens": prompt_tokens,
                                                 "completion_tokens": n,
                                                 "total_tokens": prompt_tokens + n}})
        await send("[DONE]")
        return resp


def _specs(n: int, prompt_len: int = 16, output_len: int = 5) -> list[RequestSpec]:
    return random_requests(n, prompt_len, output_len, 0.0, 1000, math.inf, seed=1)


# --------------------------------------------------------------------------- client


async def test_streams_are_timed_and_counted():
    specs = _specs(6, output_len=5)
    with FakeServer() as srv:
        results = await run_benchmark(srv.base_url, specs, model="fake", progress=False)
    assert len(srv.bodies) == 6
    assert [b["prompt"] for b in srv.bodies if b["prompt"] == list(specs[0].prompt)]
    assert all(b["max_tokens"] == 5 for b in srv.bodies)
    assert [r.index for r in results] == list(range(6))
    for r, spec in zip(results, specs, strict=True):
        assert r.success, r.error
        assert r.output_tokens == 5
        assert r.prompt_tokens == spec.prompt_len == 16
        # Timed at the first token, after the server's delay, not at the role chunk
        # before it; and not at the end: four positive gaps follow, inside the stream.
        # Only what the server slept bounds anything from below: a loaded machine can
        # stretch any step, and a late chunk shortens the gap after it, so one gap
        # alone has no lower bound (CI saw 9 ms against a 10 ms sleep).
        assert r.ttft_s >= 0.9 * FIRST_DELAY_S
        assert len(r.itl_s) == 4 and min(r.itl_s) > 0
        assert r.e2e_s >= r.ttft_s + sum(r.itl_s) - 1e-6
        assert r.e2e_s >= 0.9 * (FIRST_DELAY_S + 4 * GAP_S)
        assert r.tpot_s == pytest.approx((r.e2e_s - r.ttft_s) / 4)
    itls = [x for r in results for x in r.itl_s]

    summary = summarize(results, results_duration(results))
    assert summary.keys() >= SUMMARY_KEYS
    assert (summary["completed"], summary["failed"], summary["errors"]) == (6, 0, [])
    assert summary["total_output_tokens"] == 30
    assert summary["total_input_tokens"] == 96
    assert summary["output_len_mismatch"] == 0
    assert summary["p50_ttft_ms"] == pytest.approx(
        1000 * statistics.median(r.ttft_s for r in results))
    assert summary["p50_itl_ms"] == pytest.approx(1000 * statistics.median(itls))
    assert summary["p50_ttft_ms"] >= 0.9 * 1000 * FIRST_DELAY_S
    assert summary["goodput"] is None
    assert summary["output_throughput"] == pytest.approx(30 / summary["duration_s"])


async def test_without_usage_tokens_are_counted_from_chunks():
    with FakeServer(usage=False) as srv:
        results = await run_benchmark(srv.base_url, _specs(3, output_len=7), model="fake",
                                      progress=False)
    assert [(r.success, r.output_tokens, r.prompt_tokens) for r in results] == \
        [(True, 7, None)] * 3


async def test_http_400_is_a_failure_with_its_message():
    def reject(body):
        n = len(body["prompt"])
        return f"prompt too long ({n} > 20)" if n > 20 else None

    specs = [RequestSpec((101,) * 10, 3), RequestSpec((102,) * 30, 3),
             RequestSpec((103,) * 12, 3), RequestSpec((104,) * 40, 3)]
    with FakeServer(reject=reject) as srv:
        results = await run_benchmark(srv.base_url, specs, model="fake", progress=False)
    assert [r.success for r in results] == [True, False, True, False]
    assert results[1].error == "HTTP 400: prompt too long (30 > 20)"
    assert results[3].error == "HTTP 400: prompt too long (40 > 20)"
    assert results[1].ttft_s is None and results[1].output_tokens == 0

    summary = summarize(results, results_duration(results))
    assert (summary["completed"], summary["failed"]) == (2, 2)
    assert summary["errors"] == ["request 1: HTTP 400: prompt too long (30 > 20)",
                                 "request 3: HTTP 400: prompt too long (40 > 20)"]
    assert summary["total_output_tokens"] == 6


async def test_error_event_mid_stream_is_a_failure():
    with FakeServer(break_at=2) as srv:
        results = await run_benchmark(srv.base_url, _specs(2, output_len=5), model="fake",
                                      progress=False)
    assert all(not r.success and r.error == "engine died" for r in results)
    assert [r.output_tokens for r in results] == [2, 2]


async def test_unreachable_server_fails_each_request_without_raising():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    results = await run_benchmark(f"http://127.0.0.1:{port}", _specs(3), model="fake",
                                  progress=False, timeout_s=5)
    assert len(results) == 3
    assert all(not r.success and "Connect" in r.error for r in results)


async def test_chat_sends_text_and_ignores_role_only_chunk():
    specs = _specs(2, output_len=4)
    with FakeServer() as srv:
        results = await run_benchmark(srv.base_url + "/v1", specs, model="fake",
                                      endpoint="chat", progress=False)
    contents = sorted(b["messages"][0]["content"] for b in srv.bodies)
    assert contents == sorted(prompt_text(s.prompt) for s in specs)
    for r in results:
        assert r.success, r.error
        # The role chunk comes at once; TTFT must wait for the first text after 50 ms.
        assert r.ttft_s >= 0.040
        assert r.output_tokens == 4 and len(r.itl_s) == 3
        assert r.prompt_tokens == 16


async def test_max_concurrency_caps_requests_in_flight():
    with FakeServer() as srv:
        results = await run_benchmark(srv.base_url, _specs(6, output_len=3), model="fake",
                                      max_concurrency=2, progress=False)
    assert all(r.success for r in results)
    assert srv.peak_in_flight == 2
    # Three waves of two: the last wave cannot start before two requests have finished.
    starts = sorted(r.start_s for r in results)
    assert starts[4] >= 2 * FIRST_DELAY_S


async def test_requests_are_sent_at_their_arrival_times():
    arrivals = [0.0, 0.15, 0.3]
    specs = [RequestSpec((200,) * 8, 2, t) for t in arrivals]
    with FakeServer() as srv:
        results = await run_benchmark(srv.base_url, specs, model="fake", progress=False)
    for r, t in zip(results, arrivals, strict=True):
        assert r.arrival_s == t
        assert t - 0.005 <= r.start_s <= t + 0.1


async def test_sse_reassembles_lines_split_across_reads():
    class Pieces:
        async def iter_any(self):
            for p in (b'data: {"a"', b': 1}\n\n: comment\ndata: {"b": 2}\n', b"\ndata: [DONE]"):
                yield p

    assert [d async for d, _ in sse_data(Pieces())] == ['{"a": 1}', '{"b": 2}', "[DONE]"]


def test_endpoint_url():
    assert endpoint_url("http://h:1", "completions") == "http://h:1/v1/completions"
    assert endpoint_url("http://h:1/v1/", "chat") == "http://h:1/v1/chat/completions"
    with pytest.raises(ValueError, match="endpoint"):
        endpoint_url("http://h:1", "embeddings")


# --------------------------------------------------------------------------- summary


def _result(index, ttft_ms, e2e_ms, out, success=True, itl_ms=()):
    return RequestResult(index=index, prompt_len=10, output_len=out, success=success,
                         output_tokens=out if success else 0, prompt_tokens=None,
                         ttft_s=ttft_ms / 1000 if success else None,
                         itl_s=tuple(x / 1000 for x in itl_ms), e2e_s=e2e_ms / 1000,
                         arrival_s=0.0, start_s=0.0, error=None if success else "boom")


def test_summarize_exact_numbers_and_goodput():
    results = [
        _result(0, 100, 1100, 11, itl_ms=[100] * 10),   # tpot 100 ms
        _result(1, 300, 800, 6, itl_ms=[100] * 5),      # tpot 100 ms, ttft misses
        _result(2, 50, 50, 1),                          # no tpot: cannot miss it
        _result(3, 100, 2100, 11, itl_ms=[200] * 10),   # tpot 200 ms misses
        _result(4, 0, 5, 0, success=False),
    ]
    summary = summarize(results, 2.0, Slo(ttft_ms=200, tpot_ms=150))
    assert (summary["completed"], summary["failed"]) == (4, 1)
    assert summary["errors"] == ["request 4: boom"]
    assert summary["total_output_tokens"] == 29
    assert summary["total_input_tokens"] == 40
    assert summary["request_throughput"] == 2.0
    assert summary["output_throughput"] == 14.5
    assert summary["total_token_throughput"] == 34.5
    assert summary["mean_ttft_ms"] == pytest.approx(137.5)
    assert summary["p50_ttft_ms"] == pytest.approx(100)
    assert summary["mean_tpot_ms"] == pytest.approx(400 / 3)
    assert summary["mean_e2e_ms"] == pytest.approx(1012.5)
    assert summary["p50_itl_ms"] == pytest.approx(100)
    assert summary["mean_itl_ms"] == pytest.approx((15 * 100 + 10 * 200) / 25)
    assert summary["goodput"] == 1.0  # requests 0 and 2, over 2 s
    assert summary["goodput_fraction"] == pytest.approx(2 / 5)

    only_ttft = summarize(results, 2.0, Slo(ttft_ms=200))
    assert only_ttft["goodput_fraction"] == pytest.approx(3 / 5)


def test_summarize_of_nothing_successful_has_no_latencies():
    summary = summarize([_result(0, 0, 5, 0, success=False)], 0.0)
    assert summary["completed"] == 0 and summary["request_throughput"] == 0.0
    assert summary["p99_ttft_ms"] is None and summary["mean_itl_ms"] is None


def test_slo_must_be_positive():
    with pytest.raises(ValueError, match="ttft_ms"):
        Slo(ttft_ms=0)


# --------------------------------------------------------------------------- CLI


def test_cli_prints_table_and_writes_json_and_png(tmp_path, capsys):
    with FakeServer() as srv:
        summary = main(["--base-url", srv.base_url, "--model", "fake", "--dataset",
                        "shared-prefix", "--num-prompts", "4", "--num-groups", "2",
                        "--prefix-len", "8", "--suffix-len", "4", "--output-len", "3",
                        "--request-rate", "inf", "--slo-ttft-ms", "1000",
                        "--slo-tpot-ms", "1000", "--label", "t", "--out", str(tmp_path),
                        "--api-key", "sk-secret", "--no-progress"])
    table = capsys.readouterr().out
    assert "TTFT" in table and "Goodput" in table
    report = json.loads((tmp_path / "serve-t.json").read_text())
    assert report["summary"] == summary
    assert report["summary"]["completed"] == 4 and report["summary"]["goodput_fraction"] == 1.0
    assert report["config"]["request_rate"] == "inf"
    assert "api_key" not in report["config"]
    records = report["requests"]
    assert [r["index"] for r in records] == [0, 1, 2, 3]
    assert all(r["output_tokens"] == 3 and len(r["itl_s"]) == 2 and r["prompt_len"] == 12
               for r in records)
    assert (tmp_path / "serve-t.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_rejects_request_rate_for_trace(tmp_path):
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--dataset", "trace", "--trace", "x", "--request-rate", "2"])
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--dataset", "trace"])


# --------------------------------------------------------------------------- datasets


def test_random_lengths_in_range_and_deterministic_per_seed():
    specs = random_requests(200, 100, 20, 0.5, 1000, math.inf, seed=7)
    in_lens = [s.prompt_len for s in specs]
    out_lens = [s.output_len for s in specs]
    assert min(in_lens) >= 50 and max(in_lens) <= 150
    assert min(out_lens) >= 10 and max(out_lens) <= 30
    assert len(set(in_lens)) > 20  # really spread over the range
    assert all(100 <= t < 1000 for s in specs for t in s.prompt)
    assert all(s.arrival_s == 0.0 for s in specs)
    assert specs == random_requests(200, 100, 20, 0.5, 1000, math.inf, seed=7)
    assert specs != random_requests(200, 100, 20, 0.5, 1000, math.inf, seed=8)

    exact = random_requests(5, 64, 8, 0.0, 1000, math.inf, seed=0)
    assert [(s.prompt_len, s.output_len) for s in exact] == [(64, 8)] * 5
    with pytest.raises(ValueError, match="range_ratio"):
        random_requests(1, 10, 10, 1.0, 1000, math.inf, seed=0)


def test_poisson_arrivals():
    rng = np.random.default_rng(0)
    times = poisson_arrivals(4000, 50.0, rng)
    assert times[0] == 0.0 and times == sorted(times)
    assert np.mean(np.diff(times)) == pytest.approx(1 / 50, rel=0.1)
    assert poisson_arrivals(3, math.inf, rng) == [0.0, 0.0, 0.0]
    specs = random_requests(10, 8, 2, 0.0, 1000, 5.0, seed=3)
    assert specs[-1].arrival_s > 0 and specs == random_requests(10, 8, 2, 0.0, 1000, 5.0, 3)


def test_shared_prefix_groups_share_exactly_the_prefix():
    specs = shared_prefix_requests(12, 3, 32, 8, 4, 1000, math.inf, seed=5)
    assert all(s.prompt_len == 40 and s.output_len == 4 for s in specs)
    for i, a in enumerate(specs):
        for j, b in enumerate(specs[i + 1:], i + 1):
            common = next((k for k, (x, y) in enumerate(zip(a.prompt, b.prompt, strict=True))
                           if x != y), 40)
            assert common == (32 if i % 3 == j % 3 else 0), (i, j, common)


def _write_trace(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_trace_blocks_lengths_and_arrivals(tmp_path):
    trace = _write_trace(tmp_path / "t.jsonl", [
        {"timestamp": 1000, "input_length": 700, "output_length": 40, "hash_ids": [1, 2]},
        {"timestamp": 1500, "input_length": 1024, "output_length": 7, "hash_ids": [1, 3]},
        {"timestamp": 3000, "input_length": 100, "output_length": 0, "hash_ids": [4]},
    ])
    specs = trace_requests(trace, block_size=16, time_scale=0.5, vocab_size=1000)
    assert [s.prompt_len for s in specs] == [22, 32, 3]  # round(700/32), 1024/32, round(3.125)
    assert [s.output_len for s in specs] == [40, 7, 1]
    assert [s.arrival_s for s in specs] == [0.0, 0.25, 1.0]
    b1 = block_tokens(1, 16, 1000)
    assert specs[0].prompt[:16] == specs[1].prompt[:16] == b1
    assert specs[0].prompt[16:] == block_tokens(2, 16, 1000)[:6]
    assert specs[1].prompt[16:] == block_tokens(3, 16, 1000)
    assert specs[0].prompt[16:22] != specs[1].prompt[16:22]
    assert block_tokens(1, 16, 1000) == block_tokens(1, 512, 1000)[:16]
    assert all(100 <= t < 1000 for t in block_tokens(9, 512, 1000))

    capped = trace_requests(trace, block_size=16, vocab_size=1000, max_input_len=20,
                            max_output_len=10, max_requests=2)
    assert [(s.prompt_len, s.output_len) for s in capped] == [(20, 10), (20, 7)]
    assert capped[0].prompt == specs[0].prompt[:20]
    full = trace_requests(trace, vocab_size=1000)
    assert [s.prompt_len for s in full] == [700, 1024, 100]
    assert [s.arrival_s for s in full] == [0.0, 0.5, 2.0]


def test_trace_rejects_input_longer_than_its_blocks(tmp_path):
    trace = _write_trace(tmp_path / "bad.jsonl", [
        {"timestamp": 0, "input_length": 1100, "output_length": 1, "hash_ids": [1, 2]}])
    with pytest.raises(ValueError, match="exceeds"):
        trace_requests(trace, block_size=16)


@pytest.mark.skipif(not REAL_TRACE.exists(), reason=f"Mooncake trace not present at {REAL_TRACE}")
def test_real_trace_first_50_lines():
    lines = [json.loads(line) for line in REAL_TRACE.open().readlines()[:50]]
    specs = trace_requests(REAL_TRACE, block_size=16, max_requests=50)
    assert len(specs) == 50
    assert [s.prompt_len for s in specs] == [max(1, round(r["input_length"] / 32))
                                             for r in lines]
    assert [s.output_len for s in specs] == [max(1, r["output_length"]) for r in lines]
    t0 = lines[0]["timestamp"]
    assert [s.arrival_s for s in specs] == [(r["timestamp"] - t0) / 1000 for r in lines]
    # Requests sharing a leading hash id share that block's tokens.
    zero = block_tokens(0, 16, 49152)
    for spec, rec in zip(specs, lines, strict=True):
        if rec["hash_ids"][0] == 0 and spec.prompt_len >= 16:
            assert spec.prompt[:16] == zero
