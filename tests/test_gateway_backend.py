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
