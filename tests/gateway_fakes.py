"""A fake conductor and two fake decode workers on real ZeroMQ sockets, in one process,
for the gateway's failover tests: each test says exactly what a worker answers and what
a lost worker still sends."""

from __future__ import annotations

import asyncio
import contextlib

import zmq.asyncio

from common.protocol import (
    Abort,
    Ack,
    Error,
    Generate,
    ListWorkers,
    Route,
    RouteReply,
    Tokens,
    WorkerInfo,
    WorkerList,
    WorkerStatus,
)
from common.zmq_io import PushSocket
from common.zmq_rpc import RpcServer
from services.gateway.cluster_backend import ClusterBackend
from services.gateway.failover import FailoverSettings


def worker_status(wid: str, addr: str, alive: bool) -> WorkerStatus:
    return WorkerStatus(info=WorkerInfo(wid, "decode", "m", addr, "", "h", 16, 64, "fp"),
                        alive=alive)


async def until(cond, within_s: float = 5.0) -> None:
    async with asyncio.timeout(within_s):
        while not cond():
            await asyncio.sleep(0.01)


class FakeCluster:
    """A conductor and decode workers ``d0``, ``d1``. Route picks the first worker marked
    alive and not excluded ("unavailable" if none). A worker's mode: ``ack`` admits
    ``Generate``, ``refuse`` answers ``unavailable`` (it is shutting down), ``silent``
    never answers (frozen); every ``Generate`` and ``Abort`` is recorded."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.ctx = ctx
        self.alive = {"d0": True, "d1": True}
        self.mode = {"d0": "ack", "d1": "ack"}
        self.generated: list[tuple[str, str, Generate]] = []  # (worker, wire id, record)
        self.aborted: list[tuple[str, str]] = []
        self.excludes: list[list[str]] = []  # each Route's exclude list
        self.routes = 0  # Routes answered, "unavailable" ones too
        self.workers = {wid: RpcServer(ctx, "tcp://127.0.0.1:*", self._worker(wid),
                                       name=wid) for wid in self.alive}
        self.conductor = RpcServer(ctx, "tcp://127.0.0.1:*", self._conductor,
                                   name="fake-conductor")
        self.push: PushSocket | None = None

    async def start(self) -> None:
        for w in self.workers.values():
            await w.start()
        await self.conductor.start()

    async def close(self) -> None:
        if self.push is not None:
            await self.push.close()
        for w in self.workers.values():
            await w.close()
        await self.conductor.close()

    async def _conductor(self, msg):
        if isinstance(msg.record, Route):
            self.routes += 1
            self.excludes.append(list(msg.record.exclude))
            wid = next((w for w, up in self.alive.items()
                        if up and w not in msg.record.exclude), None)
            if wid is None:
                return Error("unavailable", "no live decode or unified worker")
            return RouteReply(wid, self.workers[wid].address, None, None, "test")
        if isinstance(msg.record, ListWorkers):
            return WorkerList([worker_status(w, s.address, self.alive[w])
                               for w, s in self.workers.items()])
        return None

    def _worker(self, wid: str):
        async def handle(msg):
            rid = msg.envelope.request_id
            if isinstance(msg.record, Abort):
                self.aborted.append((wid, rid))
                return Ack(detail="aborted")
            if isinstance(msg.record, Generate):
                self.generated.append((wid, rid, msg.record))
                mode = self.mode.get(wid, "ack")  # a worker a test added later admits
                if mode == "refuse":
                    return Error("unavailable", f"{wid} is shutting down")
                if mode == "silent":
                    await asyncio.Event().wait()
                return Ack()
            return None
        return handle

    async def send(self, stream_addr: str, wire_id: str, tokens: Tokens) -> None:
        if self.push is None:
            self.push = PushSocket(self.ctx, stream_addr, bind=False)
        await self.push.send(tokens, request_id=wire_id)

    async def wait_generated(self, n: int, task: asyncio.Task | None = None,
                             within_s: float = 10.0) -> tuple[str, str, Generate]:
        """The ``n``-th Generate received; what ``task`` raised if it ended first."""
        async with asyncio.timeout(within_s):
            while len(self.generated) < n:
                if task is not None and task.done():
                    task.result()
                    raise AssertionError(f"ended after {len(self.generated)} Generate(s)")
                await asyncio.sleep(0.01)
        return self.generated[n - 1]


@contextlib.asynccontextmanager
async def fake_cluster_and_backend(stall_check_s: float):
    """A started ``FakeCluster`` and a ``ClusterBackend`` in front of it (Generate
    timeout 2 s, route wait 1.5 s, lost-worker wait 2 s); both closed after."""
    ctx = zmq.asyncio.Context()
    cluster = FakeCluster(ctx)
    await cluster.start()
    backend = ClusterBackend(ctx, cluster.conductor.address, "tcp://127.0.0.1:*", "m",
                             rpc_timeout_s=2.0, stall_check_s=stall_check_s,
                             failover=FailoverSettings(wait_s=2.0, poll_s=0.1,
                                                       route_wait_s=1.5, route_poll_s=0.05))
    await backend.start()
    try:
        yield cluster, backend
    finally:
        await backend.close()
        await cluster.close()
        ctx.term()
