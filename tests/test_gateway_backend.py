"""The gateway's cluster backend against a fake conductor and a fake decode worker (real
ZeroMQ sockets, one process): an abandoned request is aborted on its worker however it
ends, and a dead token dispatcher fails requests at once instead of leaving them hanging.
"""

from __future__ import annotations

import asyncio

import pytest
import zmq.asyncio

from common.protocol import Abort, Ack, Error, Generate, ListWorkers, Route, RouteReply
from common.zmq_rpc import RpcServer
from services.gateway.backend import BackendUnavailable, GenerationRequest
from services.gateway.cluster_backend import ClusterBackend

pytestmark = pytest.mark.timeout(60)

SAMPLING = {"max_tokens": 1000, "temperature": 0.0}


class FakeCluster:
    """A conductor that routes every request to one decode worker, and that worker:
    it admits ``Generate`` after ``admit_delay_s`` and records what it is sent."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.admit_delay_s = 0.0
        self.generated: list[str] = []
        self.aborted: list[str] = []
        self.worker = RpcServer(ctx, "tcp://127.0.0.1:*", self._worker, name="fake-decode")
        self.conductor = RpcServer(ctx, "tcp://127.0.0.1:*", self._conductor,
                                   name="fake-conductor")

    async def start(self) -> None:
        await self.worker.start()
        await self.conductor.start()

    async def close(self) -> None:
        await self.worker.close()
        await self.conductor.close()

    async def _conductor(self, msg):
        if isinstance(msg.record, Route):
            return RouteReply("decode-0", self.worker.address, None, None, "test")
        if isinstance(msg.record, ListWorkers):
            return Error("unsupported", "no worker list here")
        return None

    async def _worker(self, msg):
        rid = msg.envelope.request_id
        if isinstance(msg.record, Generate):
            self.generated.append(rid)
            await asyncio.sleep(self.admit_delay_s)
            return Ack()
        if isinstance(msg.record, Abort):
            self.aborted.append(rid)
            return Ack(detail="aborted")
        return None

    async def wait_aborted(self, rid: str, within_s: float = 3.0) -> None:
        async with asyncio.timeout(within_s):
            while rid not in self.aborted:
                await asyncio.sleep(0.01)


@pytest.fixture
async def cluster():
    ctx = zmq.asyncio.Context()
    fake = FakeCluster(ctx)
    await fake.start()
    backend = ClusterBackend(ctx, fake.conductor.address, "tcp://127.0.0.1:*", "m",
                             rpc_timeout_s=0.5, stall_check_s=30)
    await backend.start()
    yield fake, backend
    await backend.close()
    await fake.close()
    ctx.term()


async def _consume(backend: ClusterBackend, rid: str) -> list:
    return [event async for event in backend.generate(GenerationRequest(rid, [1, 2, 3],
                                                                        SAMPLING))]


async def test_cancelled_consumer_aborts_the_request_on_its_worker(cluster):
    fake, backend = cluster
    task = asyncio.create_task(_consume(backend, "r-cancel"))
    async with asyncio.timeout(3):
        while "r-cancel" not in fake.generated or "r-cancel" not in backend.queues:
            await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)  # the Ack is back: the request runs on the worker
    task.cancel()  # a client that left, a timeout, an SDK abort: all cancel the consumer
    await asyncio.gather(task, return_exceptions=True)
    await fake.wait_aborted("r-cancel")
    assert "r-cancel" not in backend.queues and "r-cancel" not in backend.decoders


async def test_closed_stream_aborts_the_request_on_its_worker(cluster):
    fake, backend = cluster
    events = backend.generate(GenerationRequest("r-close", [1, 2, 3], SAMPLING))
    waiting = asyncio.ensure_future(anext(events))
    async with asyncio.timeout(3):
        while "r-close" not in backend.decoders:
            await asyncio.sleep(0.01)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    await events.aclose()
    await fake.wait_aborted("r-close")


async def test_generate_that_times_out_after_admission_is_aborted(cluster):
    fake, backend = cluster
    fake.admit_delay_s = 1.0  # the worker admits it, but only after the gateway gave up
    with pytest.raises(BackendUnavailable):
        await _consume(backend, "r-slow")
    await fake.wait_aborted("r-slow")


async def test_explicit_abort_is_sent_once(cluster):
    fake, backend = cluster
    task = asyncio.create_task(_consume(backend, "r-once"))
    async with asyncio.timeout(3):
        while "r-once" not in backend.decoders:
            await asyncio.sleep(0.01)
    await backend.abort("r-once")
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await asyncio.sleep(0.2)
    assert fake.aborted == ["r-once"]


async def test_dead_dispatcher_fails_waiting_requests_at_once(cluster):
    fake, backend = cluster
    task = asyncio.create_task(_consume(backend, "r-orphan"))
    async with asyncio.timeout(3):
        while "r-orphan" not in backend.decoders:
            await asyncio.sleep(0.01)
    backend._task.cancel()  # the token dispatcher dies
    async with asyncio.timeout(2):
        [event] = await task
    assert event.finished and event.finish_reason == "error"
    assert "token stream" in event.error
    assert not await backend.ready()
    with pytest.raises(BackendUnavailable):
        await _consume(backend, "r-late")
    await fake.wait_aborted("r-orphan")  # the worker is told, too


@pytest.fixture
async def gateway(tok_dir, monkeypatch):
    """The whole gateway (``serve``) in this process over the fake cluster:
    (fake, backend, http client, the serve task). ``shutdown_grace_s`` is 1 s."""
    import httpx
    from prometheus_client import CollectorRegistry

    from services.gateway import server
    from services.gateway.openai_api import create_app
    from tests.cluster import free_port

    made: list[ClusterBackend] = []

    class Recorded(ClusterBackend):
        async def start(self) -> None:
            made.append(self)
            await super().start()

    monkeypatch.setattr(server, "ClusterBackend", Recorded)
    # serve registers its metrics globally, once per process; here it runs per test.
    monkeypatch.setattr(server, "create_app", lambda *a, **kw: create_app(
        *a, metrics_registry=CollectorRegistry(), **kw))
    ctx = zmq.asyncio.Context()
    fake = FakeCluster(ctx)
    await fake.start()
    port = free_port()
    settings = server.GatewaySettings(
        model="m", http_port=port, zmq_addr=f"tcp://127.0.0.1:{free_port()}",
        conductor_addr=fake.conductor.address, stream_bind="tcp://127.0.0.1:*",
        tokenizer_dir=tok_dir, max_model_len=512, request_timeout_s=120, shutdown_grace_s=1)
    stop = asyncio.Event()
    serving = asyncio.create_task(server.serve(settings, stop))
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
            async with asyncio.timeout(20):
                while True:
                    try:
                        await c.get("/health")  # 503: no worker listed; but it serves
                        break
                    except httpx.TransportError:
                        if serving.done():
                            serving.result()  # raises why it did not start
                        await asyncio.sleep(0.05)
            assert made and made[0].dispatching
            yield fake, made[0], c, serving, stop
    finally:
        stop.set()
        await asyncio.gather(serving, return_exceptions=True)
        await fake.close()
        ctx.term()


async def _open_request(fake: FakeCluster, c) -> asyncio.Task:
    pending = asyncio.create_task(c.post("/v1/completions", json={
        "model": "m", "prompt": [1, 2, 3], "max_tokens": 100}))
    async with asyncio.timeout(10):
        while not fake.generated:
            await asyncio.sleep(0.02)
    await asyncio.sleep(0.1)  # admitted
    return pending


async def test_gateway_with_a_dead_dispatcher_answers_and_stops_at_once(gateway):
    """When the token dispatcher dies, the request waiting for tokens is answered at
    once and serve ends with LoopFailed, instead of holding the HTTP server's shutdown
    until the request times out."""
    from common.service_main import LoopFailed

    fake, backend, c, serving, _ = gateway
    pending = await _open_request(fake, c)
    backend._task.cancel()
    async with asyncio.timeout(3):
        r = await pending
    assert r.status_code == 500 and "token stream" in r.json()["error"]["message"]
    with pytest.raises(LoopFailed, match="_dispatch"):
        async with asyncio.timeout(8):
            await serving


async def test_gateway_metrics_count_refused_control_messages(gateway):
    """/metrics carries the control plane's refusals (none here: plain mode checks no
    roles; tests/test_zmq_auth.py counts real ones)."""
    _, _, c, _, _ = gateway
    text = (await c.get("/metrics")).text
    assert "# TYPE pdserve:control_forbidden_total counter" in text
    assert "pdserve:control_unknown_keys_total 0.0" in text


async def test_stop_gives_open_requests_a_grace_then_aborts_them(gateway):
    fake, _, c, serving, stop = gateway
    pending = await _open_request(fake, c)
    started = asyncio.get_running_loop().time()
    stop.set()
    async with asyncio.timeout(8):
        await serving
    assert asyncio.get_running_loop().time() - started < 5  # grace 1 s, not the timeout
    await fake.wait_aborted(fake.generated[0])
    await asyncio.gather(pending, return_exceptions=True)


async def test_a_cancel_that_lands_as_a_token_arrives_is_not_lost():
    """The consumer is cancelled in the same loop turn its next token arrives: it must
    still stop (on Python 3.11 ``asyncio.wait_for`` would return the token instead)."""
    import types

    fake = types.SimpleNamespace(stall_check_s=30.0)
    q: asyncio.Queue = asyncio.Queue()
    route = RouteReply(decode_id="d", decode_addr="tcp://127.0.0.1:1", prefill_id=None,
                       prefill_addr=None, reason="test")
    waiting = asyncio.create_task(ClusterBackend._next(fake, q, route))
    await asyncio.sleep(0)  # it now waits on the queue
    q.put_nowait("token")
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert waiting.cancelled()
