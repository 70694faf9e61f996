"""What the gateway refuses and whom it lets in, on both entry points, over a fake backend:
body size and JSON shape limits, SLOs no request can meet, a large prompt that must not
stall other requests, per-client request ids, API keys and tenant-bound cache salts on
the ZeroMQ client port."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from common.client import AsyncClient, GenerationError
from common.protocol import Abort, ClientChunk, ClientRequest, Error, decode, encode
from common.tokenizer import TextTokenizer
from services.gateway.openai_api import create_app
from services.gateway.pipeline import RequestPipeline
from services.gateway.zmq_frontend import ZmqFrontend
from tests.test_gateway_http import MAX_LEN, MODEL, FakeBackend

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def tok(tok_dir):
    return TextTokenizer.from_dir(tok_dir)


def http_client(backend, tok, **kw) -> httpx.AsyncClient:
    app = create_app(backend, tok, model_name=MODEL, max_model_len=MAX_LEN,
                     metrics_registry=CollectorRegistry(), **kw)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw",
                             timeout=60)


# ---- HTTP -------------------------------------------------------------------------------

async def test_oversize_body_is_413_in_openai_format(tok):
    backend = FakeBackend(tok)
    async with http_client(backend, tok, max_body_bytes=1000) as c:
        big = {"model": MODEL, "prompt": "x" * 2000, "max_tokens": 1}
        r = await c.post("/v1/completions", json=big)
        assert r.status_code == 413
        error = r.json()["error"]
        assert error["code"] == "request_too_large" and "1000 bytes" in error["message"]

        async def chunks():  # no Content-Length: the limit holds while reading
            for _ in range(4):
                yield b" " * 400
        r = await c.post("/v1/completions", content=chunks())
        assert r.status_code == 413
        ok = await c.post("/v1/completions", json={"model": MODEL, "prompt": "x",
                                                   "max_tokens": 1})
        assert ok.status_code == 200
    assert len(backend.requests) == 1


@pytest.mark.parametrize("raw, fragment", [
    ('{"model": "%s", "prompt": "\\ud800 hi"}', "surrogate"),
    ('{"model": "%s", "messages": [{"role": "user", "content": "\\udfff"}]}', "surrogate"),
    ('{"model": "%s", "prompt": "x", "user": ' + "[" * 100 + "]" * 100 + "}", "nested"),
    ('{"model": "%s", "prompt": "x", "user": ' + "[" * 50000 + "]" * 50000 + "}", "nested"),
])
async def test_unusable_json_is_400_not_500(tok, raw, fragment):
    backend = FakeBackend(tok)
    path = "/v1/chat/completions" if "messages" in raw else "/v1/completions"
    async with http_client(backend, tok) as c:
        r = await c.post(path, content=(raw % MODEL).encode(),
                         headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"]
    assert backend.requests == []


@pytest.mark.parametrize("field", ["slo_ttft_ms", "slo_tbt_ms"])
async def test_an_slo_no_request_can_meet_is_400(tok, field):
    backend = FakeBackend(tok)
    async with http_client(backend, tok) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "x",
                                                   "max_tokens": 1, field: 0.001})
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["param"] == field and "at least 1 milliseconds" in error["message"]
        ok = await c.post("/v1/completions", json={"model": MODEL, "prompt": "x",
                                                   "max_tokens": 1, field: 50})
        assert ok.status_code == 200
    assert getattr(backend.requests[-1], field) == 50


async def test_health_answers_while_a_large_prompt_is_tokenized(tok):
    backend = FakeBackend(tok)
    prompt = "the quick brown fox jumps. " * 60_000  # 1.6 MB: a second or more to tokenize
    async with http_client(backend, tok) as c:
        big = asyncio.create_task(c.post("/v1/completions",
                                         json={"model": MODEL, "prompt": prompt}))
        await asyncio.sleep(0.3)  # sent, parsed, tokenizing
        latencies = []
        while not big.done():
            started = time.monotonic()
            assert (await c.get("/health")).status_code == 200
            latencies.append(time.monotonic() - started)
            await asyncio.sleep(0.02)
        r = await big
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"]
    # On the event loop, tokenizing stalled /health for the whole encode (seconds).
    assert len(latencies) >= 3, latencies
    assert max(latencies) < 1.0, latencies


# ---- ZeroMQ client port -----------------------------------------------------------------

@pytest.fixture
async def zmq_gateway(tok):
    """(frontend, backend, connect) with a slow fake backend; ``connect()`` gives a new
    DEALER socket (a new client identity)."""
    ctx = zmq.asyncio.Context()
    backend = FakeBackend(tok, delay=0.02, repeat=True)
    made: list[ZmqFrontend] = []
    socks: list[zmq.asyncio.Socket] = []

    async def start(**kw) -> ZmqFrontend:
        frontend = ZmqFrontend(ctx, "tcp://127.0.0.1:*", backend,
                               RequestPipeline(tok, MAX_LEN), tok, MODEL, **kw)
        await frontend.start()
        made.append(frontend)
        return frontend

    def connect() -> zmq.asyncio.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(made[-1].address)
        socks.append(sock)
        return sock

    yield start, backend, connect
    for sock in socks:
        sock.close(0)
    for frontend in made:
        await frontend.close()
    ctx.term()


def request(max_tokens: int = 10, **kw) -> ClientRequest:
    return ClientRequest(model=MODEL, sampling={"max_tokens": max_tokens}, prompt="Hi", **kw)


async def replies(sock, rid: str, *, first_only: bool = False,
                  through_errors: bool = False) -> list:
    """Records addressed to ``rid``: up to its last chunk, or the first other record
    (an Error unless ``through_errors``, an Ack)."""
    out = []
    async with asyncio.timeout(10):
        while True:
            msg = decode(await sock.recv_multipart())
            if msg.envelope.request_id != rid:
                continue
            rec = msg.record
            out.append(rec)
            if first_only or (isinstance(rec, ClientChunk) and rec.finished):
                return out
            if not isinstance(rec, ClientChunk) and not (through_errors
                                                         and isinstance(rec, Error)):
                return out


async def test_reused_request_id_is_refused_and_the_first_runs_on(zmq_gateway):
    start, backend, connect = zmq_gateway
    await start()
    a, b = connect(), connect()
    await a.send_multipart(encode(request(), request_id="same"))
    first = await replies(a, "same", first_only=True)
    await a.send_multipart(encode(request(), request_id="same"))
    await b.send_multipart(encode(request(), request_id="same"))  # another client's "same"
    got = first + await replies(a, "same", through_errors=True)
    refused = [r for r in got if isinstance(r, Error)]
    assert len(refused) == 1 and refused[0].code == "bad_request"
    assert "already running" in refused[0].message
    chunks = [r for r in got if isinstance(r, ClientChunk)]
    assert chunks[-1].finished and chunks[-1].finish_reason == "length"
    assert sum(len(c.token_ids) for c in chunks) == 10
    b_chunks = await replies(b, "same")
    assert b_chunks[-1].finished and sum(len(c.token_ids) for c in b_chunks) == 10
    ids = [r.request_id for r in backend.requests]
    assert len(ids) == len(set(ids)) == 2 and "same" not in ids


async def test_a_client_aborts_only_its_own_requests(zmq_gateway):
    start, backend, connect = zmq_gateway
    await start()
    owner, other = connect(), connect()
    await owner.send_multipart(encode(request(max_tokens=40), request_id="mine"))
    await replies(owner, "mine", first_only=True)
    await other.send_multipart(encode(Abort(), request_id="mine"))
    await replies(other, "mine")  # answered (Ack), as for any unknown id
    done = await replies(owner, "mine")
    assert done[-1].finished and done[-1].finish_reason == "length"
    assert backend.aborted == []
    await owner.send_multipart(encode(request(max_tokens=100), request_id="mine-2"))
    await replies(owner, "mine-2", first_only=True)
    await owner.send_multipart(encode(Abort(), request_id="mine-2"))
    async with asyncio.timeout(3):
        while not backend.aborted:
            await asyncio.sleep(0.01)
    assert backend.aborted == [backend.requests[-1].request_id]


async def test_api_keys_are_required_and_bind_the_cache_salt(zmq_gateway):
    start, backend, connect = zmq_gateway
    frontend = await start(api_keys=("sk-one", "sk-two"))
    for key in (None, "nope"):
        sock = connect()
        await sock.send_multipart(encode(request(api_key=key), request_id="k"))
        [error] = await replies(sock, "k")
        assert isinstance(error, Error) and error.code == "unauthorized"
    assert backend.requests == []
    salts = []
    for key, salt in (("sk-one", None), ("sk-two", None), ("sk-two", "team"),
                      ("sk-one", "key-other")):
        async with AsyncClient(frontend.address, api_key=key) as client:
            done = await client.generate("Hi", max_tokens=2, cache_salt=salt)
        assert done.finish_reason == "length"
        salts.append(backend.requests[-1].cache_salt)
    one, two, team, spoof = salts
    assert one.startswith("key-") and two.startswith("key-") and one != two
    assert team == f"{two}/team" and spoof == f"{one}/key-other"  # no other tenant's salt


async def test_bad_timeout_and_error_messages_without_repeated_codes(zmq_gateway):
    start, _, connect = zmq_gateway
    frontend = await start()
    sock = connect()
    for timeout_s in (-1, 0):
        await sock.send_multipart(encode(request(timeout_s=timeout_s), request_id="t"))
        [error] = await replies(sock, "t")
        assert error.code == "bad_request" and "timeout_s" in error.message
    await sock.send_multipart([b"not a message"])
    error = decode(await sock.recv_multipart()).record
    assert isinstance(error, Error) and not error.message.startswith("[")
    async with AsyncClient(frontend.address) as client:
        with pytest.raises(GenerationError) as caught:
            await client.generate("Hi", max_tokens=10_000)
    assert str(caught.value).count("bad_request") == 1


async def test_chat_turns_the_template_cannot_render_are_a_bad_request(zmq_gateway):
    """Chat turns on the ZeroMQ port are free-form; a turn the chat template's own code
    trips on (a None content it adds to a string) is the client's error, not the
    gateway's ("internal")."""
    start, backend, connect = zmq_gateway
    await start()
    sock = connect()
    turns = [{"role": "user", "content": None}]
    await sock.send_multipart(encode(ClientRequest(
        model=MODEL, sampling={"max_tokens": 2}, messages=turns), request_id="c"))
    [error] = await replies(sock, "c")
    assert error.code == "bad_request" and "chat template error" in error.message
    assert backend.requests == []
    await sock.send_multipart(encode(ClientRequest(
        model=MODEL, sampling={"max_tokens": 2},
        messages=[{"role": "user", "content": "Hi"}]), request_id="ok"))
    chunks = await replies(sock, "ok")
    assert chunks[-1].finished and sum(len(c.token_ids) for c in chunks) == 2
