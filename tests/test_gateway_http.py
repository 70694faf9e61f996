"""The gateway's OpenAI HTTP layer over a fake backend: exact text, SSE, errors, aborts.

The fake backend replies with the token ids of ``REPLY`` followed by EOS (or cycles them
with ``repeat``), a few milliseconds apart, and records requests and aborts. Most tests
talk to the app in-process through ``httpx.ASGITransport``; the ``openai`` client tests
and the disconnect test use a real uvicorn server on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from prometheus_client import CollectorRegistry

from common.protocol import TokenLogprob, Tokens, TopLogprob
from common.tokenizer import TextTokenizer
from services.gateway.backend import (
    SAMPLING_KEYS,
    BackendOverloaded,
    BackendUnavailable,
    GenerationBackend,
)
from services.gateway.openai_api import create_app
from services.gateway.pipeline import PreparedRequest, RequestPipeline
from services.gateway.stop_strings import StopMatcher

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-test"
MAX_LEN = 128
REPLY = "Hello world! The quick brown fox jumps over the lazy dog."
CHAT = [{"role": "user", "content": "Say hello."}]


class FakeBackend(GenerationBackend):
    def __init__(self, tokenizer: TextTokenizer, delay: float = 0.002, repeat: bool = False):
        self.reply = tokenizer.encode(REPLY, add_special_tokens=False)
        self.eos = tokenizer.eos_token_id
        self.delay, self.repeat = delay, repeat
        self.requests, self.aborted, self.closed = [], [], []
        self.overloaded: float | None = None
        self.refuse: Exception | None = None
        self.error_at: int | None = None
        self.is_ready = True

    async def generate(self, request):
        self.requests.append(request)
        if self.overloaded is not None:
            raise BackendOverloaded("prefill pool is saturated", retry_after_s=self.overloaded)
        if self.refuse is not None:
            raise self.refuse
        limit = request.sampling["max_tokens"]
        ids = self.reply * limit if self.repeat else self.reply + [self.eos]
        ids = ids[:limit]
        natural_end = not self.repeat and len(self.reply) + 1 <= limit
        top = request.sampling["logprobs"]
        try:
            for pos, token in enumerate(ids):
                await asyncio.sleep(self.delay)
                if pos == self.error_at:
                    yield Tokens(pos, [], True, "error", error="decode worker died")
                    return
                last = pos == len(ids) - 1
                logprobs = [] if top is None else [TokenLogprob(
                    token, -0.5, top=[TopLogprob(token, -0.5), TopLogprob(7, -1.5)][:top])]
                yield Tokens(pos, [token], last,
                                 ("stop" if natural_end else "length") if last else None,
                                 prompt_tokens=len(request.prompt_token_ids), cached_tokens=3,
                                 logprobs=logprobs)
        finally:
            self.closed.append(request.request_id)

    async def abort(self, request_id):
        self.aborted.append(request_id)

    async def ready(self):
        return self.is_ready


@pytest.fixture(scope="module")
def tok(tok_dir):
    return TextTokenizer.from_dir(tok_dir)


@pytest.fixture
def backend(tok):
    return FakeBackend(tok)


@pytest.fixture
def make_client(tok, backend):
    """An in-process client (use it with ``async with``) for an app; kwargs go to
    create_app, ``backend`` defaults to the test's fake."""

    def build(**kw):
        kw.setdefault("metrics_registry", CollectorRegistry())
        app = create_app(kw.pop("backend", backend), tok, model_name=MODEL,
                         max_model_len=MAX_LEN, **kw)
        return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw")

    return build


@pytest.fixture
async def client(make_client):
    async with make_client() as c:
        yield c


def sse_payloads(text: str) -> list:
    blocks = text.split("\n\n")
    assert blocks[-1] == "" and blocks[-2] == "data: [DONE]", text[-200:]
    assert all(b.startswith("data: ") for b in blocks[:-1])
    return [json.loads(b[len("data: "):]) for b in blocks[:-2]]


def chat_prompt_ids(tok_dir) -> list[int]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(tok_dir)).apply_chat_template(
        CHAT, tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"])


# ---- in-process HTTP ------------------------------------------------------------------

async def test_completion_text_usage_and_sampling(client, backend, tok):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi there",
                                                    "max_tokens": 5, "seed": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    prompt = tok.encode("Hi there")
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"][0]["text"] == tok.decode(backend.reply[:5])
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 5,
                             "total_tokens": len(prompt) + 5,
                             "prompt_tokens_details": {"cached_tokens": 3}}
    sent = backend.requests[-1]
    assert sent.prompt_token_ids == prompt and sent.request_id == body["id"]
    assert sent.sampling == {"max_tokens": 5, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
                             "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                             "frequency_penalty": 0.0, "seed": 3, "stop_token_ids": [],
                             "ignore_eos": False, "logprobs": None, "min_tokens": 0}
    assert backend.aborted == []  # finished normally: nothing to abort


async def test_extension_fields_reach_the_backend(client, backend):
    r = await client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": CHAT, "max_completion_tokens": 9, "max_tokens": 3,
        "ignore_eos": True, "min_tokens": 2, "top_k": 5, "min_p": 0.1, "top_p": 0.9,
        "repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": -0.5,
        "cache_salt": "tenant-a", "stop_token_ids": [2, 5], "temperature": 0})
    assert r.status_code == 200, r.text
    sent = backend.requests[-1]
    assert set(sent.sampling) == set(SAMPLING_KEYS) and sent.cache_salt == "tenant-a"
    assert {k: sent.sampling[k] for k in ("max_tokens", "ignore_eos", "min_tokens", "top_k",
                                          "min_p", "top_p", "repetition_penalty",
                                          "stop_token_ids", "temperature")} == {
        "max_tokens": 9, "ignore_eos": True, "min_tokens": 2, "top_k": 5, "min_p": 0.1,
        "top_p": 0.9, "repetition_penalty": 1.2, "stop_token_ids": [2, 5], "temperature": 0.0}


async def test_prompt_forms(client, backend, tok):
    ids = tok.encode("Hi there")
    for prompt in ("Hi there", ids, ["Hi there"], [ids]):
        r = await client.post("/v1/completions",
                               json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert backend.requests[-1].prompt_token_ids == ids
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b"]})
    assert r.status_code == 400 and "batched" in r.json()["error"]["message"]


async def test_chat_uses_template_ids_and_default_max_tokens(client, backend, tok, tok_dir):
    r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT})
    assert r.status_code == 200, r.text
    body = r.json()
    prompt = chat_prompt_ids(tok_dir)
    assert backend.requests[-1].prompt_token_ids == prompt
    assert backend.requests[-1].sampling["max_tokens"] == MAX_LEN - len(prompt)
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": REPLY}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == len(backend.reply) + 1  # + EOS
    assert body["usage"]["prompt_tokens"] == len(prompt)


async def test_completion_stream_sse_order_and_usage(client, backend, tok):
    r = await client.post("/v1/completions", json={
        "model": MODEL, "prompt": "Hi", "max_tokens": 6, "stream": True,
        "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = sse_payloads(r.text)
    *text_chunks, usage_chunk = chunks
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == tok.decode(backend.reply[:6])
    assert [c["choices"][0]["finish_reason"] for c in text_chunks] == \
        [None] * (len(text_chunks) - 1) + ["length"]
    assert all(c["usage"] is None for c in text_chunks)
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 6


async def test_chat_stream_role_first_then_text(client, backend):
    r = await client.post("/v1/chat/completions",
                          json={"model": MODEL, "messages": CHAT, "stream": True})
    chunks = sse_payloads(r.text)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:]) == REPLY
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all("usage" not in c for c in chunks)


def _stop_token_index(tok, backend, stop):
    """Index of the token that completes ``stop``; asserts the stop spans two tokens."""
    for j in range(len(backend.reply)):
        if stop in tok.decode(backend.reply[:j + 1]):
            assert stop not in tok.decode(backend.reply[j:j + 1])
            return j
    raise AssertionError(stop)


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_string_across_tokens(client, backend, tok, stream):
    stop = "k bro"  # "quick" + " brown"
    j = _stop_token_index(tok, backend, stop)
    cut = REPLY.index(stop)
    for include, expected in ((False, REPLY[:cut]), (True, REPLY[:cut + len(stop)])):
        r = await client.post("/v1/completions", json={
            "model": MODEL, "prompt": "Hi", "stop": ["zzz", stop], "stream": stream,
            "include_stop_str_in_output": include, "stream_options":
                {"include_usage": True} if stream else None})
        assert r.status_code == 200, r.text
        if stream:
            chunks = sse_payloads(r.text)
            text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
            reason, usage = chunks[-2]["choices"][0]["finish_reason"], chunks[-1]["usage"]
            assert all("k b" not in c["choices"][0]["text"] for c in chunks[:-2])
        else:
            choice, usage = r.json()["choices"][0], r.json()["usage"]
            text, reason = choice["text"], choice["finish_reason"]
        assert (text, reason) == (expected, "stop")
        assert usage["completion_tokens"] == j + 1
        assert backend.aborted[-1] == backend.requests[-1].request_id  # on_stop aborted it


async def test_stop_string_earliest_wins_and_false_alarm_is_released(client, backend):
    r = await client.post("/v1/completions",
                          json={"model": MODEL, "prompt": "Hi", "stop": ["lazy", "The"]})
    assert r.json()["choices"][0]["text"] == "Hello world! "
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi",
                                                    "stop": "quick brown cat", "stream": True})
    chunks = sse_payloads(r.text)
    assert "".join(c["choices"][0]["text"] for c in chunks) == REPLY
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


BAD_REQUESTS = [
    ("malformed json", b"{not json", None, 400, None),
    ("not an object", [1, 2], None, 400, None),
    ("missing model", {"prompt": "x"}, None, 400, "model"),
    ("unknown model", {"model": "gpt-9", "prompt": "x"}, None, 404, "model"),
    ("max_tokens type", {"prompt": "x", "max_tokens": "ten"}, "an integer", 400, "max_tokens"),
    ("temperature -1", {"prompt": "x", "temperature": -1}, "[0.0, 2.0]", 400, "temperature"),
    ("temperature 2.5", {"prompt": "x", "temperature": 2.5}, None, 400, "temperature"),
    ("top_p 0", {"prompt": "x", "top_p": 0}, "(0.0, 1.0]", 400, "top_p"),
    ("n 2", {"prompt": "x", "n": 2}, "n must be 1", 400, "n"),
    ("prompt too long", {"prompt": [5] * MAX_LEN}, "maximum context length", 400, "prompt"),
    ("max_tokens too large", {"prompt": "x", "max_tokens": MAX_LEN}, f"{MAX_LEN} tokens", 400,
     "max_tokens"),
    ("max_tokens 0", {"prompt": "x", "max_tokens": 0}, ">= 1", 400, "max_tokens"),
    ("empty prompt", {"prompt": ""}, "empty", 400, "prompt"),
    ("token out of vocab", {"prompt": [1, 49152]}, "outside", 400, "prompt"),
    ("stop type", {"prompt": "x", "stop": 5}, None, 400, "stop"),
    ("logprobs 21", {"prompt": "x", "logprobs": 21}, None, 400, "logprobs"),
    ("min_tokens > max", {"prompt": "x", "max_tokens": 2, "min_tokens": 3}, None, 400,
     "min_tokens"),
    ("stream_options alone", {"prompt": "x", "stream_options": {"include_usage": True}}, None,
     400, "stream_options"),
    ("echo", {"prompt": "x", "echo": True}, "not supported", 400, "echo"),
]


@pytest.mark.parametrize("name,body,fragment,status,param", BAD_REQUESTS,
                         ids=[b[0] for b in BAD_REQUESTS])
async def test_bad_completion_requests(client, backend, name, body, fragment, status, param):
    if isinstance(body, dict) and name != "missing model":
        body = {"model": MODEL, **body}
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = await client.post("/v1/completions", **kw)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert fragment is None or fragment in error["message"], error["message"]
    if status == 404:
        assert error["code"] == "model_not_found"
    assert backend.requests == []


@pytest.mark.parametrize("body,param", [
    ({"messages": "hi"}, "messages"), ({"messages": [{"content": "x"}]}, "messages"),
    ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": CHAT, "max_completion_tokens": MAX_LEN}, "max_completion_tokens")])
async def test_bad_chat_requests(client, backend, body, param):
    r = await client.post("/v1/chat/completions", json={"model": MODEL, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert backend.requests == []


async def test_api_keys(make_client):
    async with make_client(api_keys=("sk-one", "sk-two")) as c:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "sk-one"}):
            r = await c.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert (await c.get("/v1/models")).status_code == 401
        ok = await c.post("/v1/completions", json=body, headers={"Authorization": "Bearer sk-two"})
        assert ok.status_code == 200
        assert (await c.get("/health")).status_code == 200  # open, for load balancers


@pytest.mark.parametrize("stream", [False, True])
async def test_backend_admission_errors(client, backend, stream):
    body = {"model": MODEL, "prompt": "x", "stream": stream}
    backend.overloaded = 2.5
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 429 and r.headers["retry-after"] == "3"
    assert r.json()["error"]["type"] == "rate_limit_error"
    backend.overloaded, backend.refuse = None, BackendUnavailable("no decode workers")
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 503 and "no decode workers" in r.json()["error"]["message"]
    backend.refuse = ValueError("prompt blocks do not fit any worker")
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 400 and "do not fit" in r.json()["error"]["message"]
    assert backend.aborted == []  # refused requests were never admitted


async def test_backend_error_event(client, backend):
    backend.error_at = 3
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 500 and "decode worker died" in r.json()["error"]["message"]
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True})
    chunks = sse_payloads(r.text)
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == \
        REPLY[:len("".join(c["choices"][0]["text"] for c in chunks[:-1]))]
    assert chunks[-1]["error"]["type"] == "server_error"


class LyingBackend(FakeBackend):
    """A worker that sends one event no working worker would: after two good ones."""

    def __init__(self, tokenizer, lie: dict):
        super().__init__(tokenizer, delay=0)
        self.lie = lie

    async def generate(self, request):
        self.requests.append(request)
        for pos in range(2):
            yield Tokens(pos, [self.reply[pos]], False, prompt_tokens=3)
        yield Tokens(**{"position": 2, "token_ids": [self.reply[2]], "finished": True,
                        "finish_reason": "length", "prompt_tokens": 3, **self.lie})


@pytest.mark.parametrize("lie, problem", [
    ({"token_ids": [49152]}, "token ids outside the vocabulary"),
    ({"token_ids": [-1]}, "token ids outside the vocabulary"),
    ({"prompt_tokens": -5}, "a negative token count"),
    ({"logprobs": [TokenLogprob(5, math.nan)]}, "a logprob that is not a finite number"),
    ({"logprobs": [TokenLogprob(5, -0.1, top=[TopLogprob(10**9, -1.0)])]},
     "token ids outside the vocabulary"),
])
@pytest.mark.parametrize("stream", [False, True])
async def test_an_event_a_worker_should_not_send_ends_the_request_with_an_error(
        make_client, tok, lie, problem, stream):
    """Detokenizing it, counting it or writing it as JSON used to raise out of the
    response (a plain 500, or a stream cut off); now the request ends with the API's
    error, the text before it intact."""
    async with make_client(backend=LyingBackend(tok, lie)) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "x",
                                                  "max_tokens": 5, "stream": stream,
                                                  "logprobs": 1})
    if stream:
        chunks = sse_payloads(r.text)
        assert "".join(ch["choices"][0]["text"] for ch in chunks[:-1]) == tok.decode(
            tok.encode(REPLY, add_special_tokens=False)[:2])
        error = chunks[-1]["error"]
    else:
        assert r.status_code == 500
        error = r.json()["error"]
    assert error["type"] == "server_error" and problem in error["message"]


@pytest.mark.parametrize("stream", [False, True])
async def test_timeout_aborts(make_client, tok, stream):
    slow = FakeBackend(tok, delay=0.05, repeat=True)
    async with make_client(backend=slow, request_timeout_s=0.3) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "x",
                                                   "stream": stream},
                         headers={"X-Request-Id": "slow-1"})
    if stream:
        assert r.status_code == 200
        assert sse_payloads(r.text)[-1]["error"]["code"] == "request_timeout"
    else:
        assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
    # The backend knows the request by the gateway's own id; X-Request-Id is a label.
    [sent] = [req.request_id for req in slow.requests]
    assert sent != "slow-1" and slow.aborted == [sent] and slow.closed == [sent]


async def test_logprobs_shapes(client, backend, tok):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x",
                                                    "max_tokens": 4, "logprobs": 2})
    lp = r.json()["choices"][0]["logprobs"]
    tokens = [tok.decode([t], skip_special_tokens=False) for t in backend.reply[:4]]
    assert lp["tokens"] == tokens and lp["token_logprobs"] == [-0.5] * 4
    assert [len(t) for t in lp["top_logprobs"]] == [2] * 4
    assert lp["text_offset"] == [sum(len(t) for t in tokens[:i]) for i in range(4)]
    r = await client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": CHAT, "max_tokens": 3, "logprobs": True, "top_logprobs": 1})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == tokens[:3]
    assert all(len(c["top_logprobs"]) == 1 and c["bytes"] == list(c["token"].encode())
               for c in content)


async def test_request_id_models_health_and_metrics(client, backend):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x",
                                                    "max_tokens": 5},
                          headers={"X-Request-Id": "req-42"})
    assert r.json()["id"] == "req-42" != backend.requests[-1].request_id
    assert r.headers["x-request-id"] == "req-42"
    models = (await client.get("/v1/models")).json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert (await client.get("/health")).status_code == 200
    backend.is_ready = False
    assert (await client.get("/health")).status_code == 503
    text = (await client.get("/metrics")).text
    assert "pdserve:time_to_first_token_seconds_count 1.0" in text
    assert "pdserve:inter_token_latency_seconds_count 4.0" in text
    assert 'pdserve:request_success_total{finish_reason="length"} 1.0' in text
    assert "pdserve:generation_tokens_total 5.0" in text
    unknown = await client.get("/v1/nothing")
    assert unknown.status_code == 404 and "error" in unknown.json()


# ---- the pipeline on its own ------------------------------------------------------------

async def test_pipeline_drops_resent_tokens_and_reports_gaps(tok):
    ids = tok.encode(REPLY, add_special_tokens=False)
    pipeline = RequestPipeline(tok, MAX_LEN)
    request = PreparedRequest([1, 2, 3], {"min_tokens": 0})

    async def events(spec):
        for event in spec:
            yield event

    # A failover resends positions 2..3: they must not be shown twice.
    resent = [Tokens(0, ids[:4]), Tokens(2, ids[2:6]),
              Tokens(6, ids[6:], finished=True, finish_reason="stop")]
    deltas = [d async for d in pipeline.stream(request, events(resent))]
    assert "".join(d.text for d in deltas) == REPLY
    assert deltas[-1].usage.completion_tokens == len(ids)
    gap = [Tokens(0, ids[:2]), Tokens(5, ids[5:6])]
    deltas = [d async for d in pipeline.stream(request, events(gap))]
    assert deltas[-1].finish_reason == "error" and "gap" in deltas[-1].error


def test_stop_matcher_holds_partial_matches():
    m = StopMatcher(["abc", "bd"])
    assert m.feed("xa") == ("x", False)
    assert m.feed("b") == ("", False)
    assert m.feed("x") == ("abx", False)
    assert m.feed("ab") == ("", False)
    assert m.feed("cz") == ("", True)
    m = StopMatcher(["END"], include_stop=True)
    assert m.feed("fin EN") == ("fin ", False) and m.feed("D!") == ("END", True)
    m = StopMatcher(["END"])
    assert m.feed("E") == ("", False) and m.flush() == "E"


def test_gateway_imports_without_torch():
    code = ("import sys\nimport services.gateway.openai_api, services.gateway.pipeline, "
            "common.tokenizer\nbad = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


# ---- a real server and the openai client ---------------------------------------------------

@contextlib.contextmanager
def serve(app):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture
def server(tok, backend):
    app = create_app(backend, tok, model_name=MODEL, max_model_len=MAX_LEN,
                     api_keys=("sk-test",), metrics_registry=CollectorRegistry())
    with serve(app) as url:
        yield openai.OpenAI(base_url=url, api_key="sk-test", max_retries=0, timeout=10)


def test_openai_client_chat(server, backend, tok_dir):
    reply = server.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=60)
    assert reply.choices[0].message.content == REPLY
    assert reply.choices[0].finish_reason == "stop"
    prompt_len = len(chat_prompt_ids(tok_dir))
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == \
        (prompt_len, len(backend.reply) + 1)
    assert reply.usage.total_tokens == prompt_len + len(backend.reply) + 1

    chunks = list(server.chat.completions.create(
        model=MODEL, messages=CHAT, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == REPLY
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(backend.reply) + 1


def test_openai_client_completions_stream(server, backend, tok):
    chunks = list(server.completions.create(model=MODEL, prompt="Hi", max_tokens=5, stream=True,
                                            stop=["lazy"]))
    assert "".join(c.choices[0].text for c in chunks) == tok.decode(backend.reply[:5])
    assert chunks[-1].choices[0].finish_reason == "length"
    chunks = list(server.completions.create(model=MODEL, prompt="Hi", stream=True,
                                            stop=["k bro"]))
    assert "".join(c.choices[0].text for c in chunks) == "Hello world! The quic"
    assert chunks[-1].choices[0].finish_reason == "stop"
    with pytest.raises(openai.NotFoundError):
        server.completions.create(model="other", prompt="Hi")
    with pytest.raises(openai.BadRequestError, match="temperature"):
        server.completions.create(model=MODEL, prompt="Hi", temperature=-1)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=str(server.base_url), api_key="wrong", max_retries=0) \
            .completions.create(model=MODEL, prompt="Hi")


def _wait_for_abort(backend, label, within_s=2.0):
    [request_id] = [req.request_id for req in backend.requests]
    assert request_id != label  # the backend's id is the gateway's own
    deadline = time.monotonic() + within_s
    while request_id not in backend.aborted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert backend.aborted == [request_id]
    time.sleep(0.1)
    assert backend.closed == [request_id]  # the backend stream was closed too


def test_client_disconnect_aborts(tok):
    slow = FakeBackend(tok, delay=0.02, repeat=True)
    app = create_app(slow, tok, model_name=MODEL, max_model_len=MAX_LEN,
                     metrics_registry=CollectorRegistry())
    with serve(app) as url:
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=10)
        stream = client.completions.create(model=MODEL, prompt="Hi", stream=True,
                                           extra_headers={"X-Request-Id": "gone-1"})
        pieces = iter(stream)
        next(pieces), next(pieces)
        stream.close()
        _wait_for_abort(slow, "gone-1")


def test_client_disconnect_aborts_non_streaming(tok):
    slow = FakeBackend(tok, delay=0.02, repeat=True)
    app = create_app(slow, tok, model_name=MODEL, max_model_len=MAX_LEN,
                     metrics_registry=CollectorRegistry())
    with serve(app) as url:
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=0.3)
        with pytest.raises(openai.APITimeoutError):
            client.completions.create(model=MODEL, prompt="Hi",
                                      extra_headers={"X-Request-Id": "gone-2"})
        _wait_for_abort(slow, "gone-2")


@pytest.mark.parametrize("stream", [False, True])
def test_client_leaving_before_its_first_token_aborts(tok, stream):
    """A request still queued (no token yet) is aborted as soon as its client leaves."""
    queued = FakeBackend(tok, delay=30.0)
    app = create_app(queued, tok, model_name=MODEL, max_model_len=MAX_LEN,
                     metrics_registry=CollectorRegistry())
    with serve(app) as url:
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=0.3)
        with pytest.raises(openai.APITimeoutError):
            reply = client.completions.create(model=MODEL, prompt="Hi", stream=stream,
                                              extra_headers={"X-Request-Id": "queued"})
            list(reply)
        _wait_for_abort(queued, "queued")


async def test_cache_salt_is_per_api_key_by_default(make_client, backend):
    async with make_client(api_keys=("sk-one", "sk-two")) as c:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
        for key, extra in (("sk-one", {}), ("sk-one", {}), ("sk-two", {}),
                           ("sk-one", {"cache_salt": "team-a"})):
            r = await c.post("/v1/completions", json={**body, **extra},
                             headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200
    one, again, two, own = (r.cache_salt for r in backend.requests[-4:])
    assert one == again and one.startswith("key-")
    assert two != one and two.startswith("key-")
    assert own == f"{one}/team-a"
    assert "sk-one" not in one  # the key itself never travels as a salt


async def test_cache_salt_passes_through_without_api_keys(client, backend):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x",
                                                   "max_tokens": 1, "cache_salt": "s1"})
    assert r.status_code == 200 and backend.requests[-1].cache_salt == "s1"
