"""The conductor process: worker registry, liveness, and routing.

Workers say Hello on the control socket and heartbeat on a SUB socket the conductor
binds. A heartbeat from a worker the conductor does not know (it restarted) makes it ask
that worker for its details, so the registry rebuilds itself within a heartbeat or two.
A worker silent for three heartbeat intervals is dead and receives no more requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from dataclasses import dataclass

import structlog
import zmq.asyncio
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from common.logging import configure_logging
from common.protocol import Error, GetStats, Heartbeat, Hello, Route, RouteReply, Stats, Welcome
from common.zmq_io import RpcClient, RpcServer, Subscriber, install_uvloop
from services.conductor.policy import NoWorkers, account, decide, make_policy
from services.conductor.registry import Registry, WorkerView

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class ConductorSettings:
    control_addr: str = "tcp://127.0.0.1:5551"
    heartbeat_addr: str = "tcp://127.0.0.1:5552"
    heartbeat_interval_s: float = 1.0
    policy: str = "least_loaded"
    disagg_threshold: int = 256  # prompts with fewer uncached tokens prefill on decode
    metrics_port: int = 0
    log_format: str = "json"


class Conductor:
    def __init__(self, settings: ConductorSettings) -> None:
        self.settings = settings
        self.ctx = zmq.asyncio.Context()
        self.registry = Registry(settings.heartbeat_interval_s)
        self.policy = make_policy(settings.policy)
        self.rpc = RpcServer(self.ctx, settings.control_addr, self._handle, name="conductor")
        self.sub = Subscriber(self.ctx, settings.heartbeat_addr, bind=True)
        self._tasks: list[asyncio.Task] = []
        self._discovering: set[str] = set()
        self.metrics = CollectorRegistry()
        self.decisions = Counter("pdserve:routing_decisions", "Routing decisions",
                                 ["reason"], registry=self.metrics)
        self.alive_workers = Gauge("pdserve:workers_alive", "Live workers", ["role"],
                                   registry=self.metrics)

    async def start(self) -> None:
        await self.rpc.start()
        self._tasks += [asyncio.create_task(self._heartbeats()),
                        asyncio.create_task(self._reaper())]
        if self.settings.metrics_port:
            start_http_server(self.settings.metrics_port, registry=self.metrics)
        log.info("conductor started", control=self.rpc.address,
                 heartbeats=self.settings.heartbeat_addr, policy=self.policy.name)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.rpc.close()
        await self.sub.close()
        self.ctx.term()

    async def _handle(self, msg):
        rec = msg.record
        if isinstance(rec, Hello):
            self.registry.register(_view_from(vars_of(rec)))
            return Welcome(conductor_id="conductor",
                           heartbeat_interval_s=self.settings.heartbeat_interval_s)
        if isinstance(rec, Route):
            return self._route(rec, msg.envelope.request_id)
        if isinstance(rec, GetStats):
            return Stats(values={"workers": [
                {k: getattr(w, k) for k in w.__slots__} for w in self.registry.workers.values()],
                "policy": self.policy.name})
        return Error("unsupported", f"{type(rec).__name__} is not handled by the conductor")

    def _route(self, rec: Route, rid: str | None):
        try:
            decision = decide(list(self.registry.workers.values()), self.policy,
                              model=rec.model, prompt_tokens=rec.prompt_len,
                              disagg_threshold=self.settings.disagg_threshold,
                              exclude=frozenset(rec.exclude))
        except NoWorkers as exc:
            return Error("unavailable", str(exc))
        account(decision, rec.prompt_len)
        self.decisions.labels(reason=decision.reason.split(" ")[0]).inc()
        log.info("routed", request_id=rid, decode=decision.decode.worker_id,
                 prefill=decision.prefill.worker_id if decision.prefill else None,
                 reason=decision.reason)
        p = decision.prefill
        return RouteReply(decode_id=decision.decode.worker_id,
                          decode_addr=decision.decode.control_addr,
                          prefill_id=p.worker_id if p else None,
                          prefill_addr=p.control_addr if p else None, reason=decision.reason)

    async def _heartbeats(self) -> None:
        while True:
            msg = await self.sub.recv()
            hb = msg.record
            if not isinstance(hb, Heartbeat):
                continue
            if not self.registry.heartbeat(hb) and hb.control_addr \
                    and hb.worker_id not in self._discovering:
                self._discovering.add(hb.worker_id)
                asyncio.create_task(self._discover(hb))

    async def _discover(self, hb: Heartbeat) -> None:
        """Learn about a worker from its heartbeat (after a conductor restart)."""
        client = RpcClient(self.ctx, hb.control_addr, name="conductor")
        try:
            reply = await client.call(GetStats(), timeout=2.0)
            self.registry.register(_view_from(reply.record.values))
            self.registry.heartbeat(hb)
        except Exception as exc:
            log.warning("could not reach worker", worker_id=hb.worker_id, error=str(exc))
        finally:
            self._discovering.discard(hb.worker_id)
            await client.close()

    async def _reaper(self) -> None:
        while True:
            await asyncio.sleep(min(0.25, self.settings.heartbeat_interval_s / 2))
            self.registry.reap()
            for role in ("prefill", "decode", "unified"):
                self.alive_workers.labels(role=role).set(len(self.registry.alive((role,))))


def vars_of(rec) -> dict:
    return {k: getattr(rec, k) for k in rec.__slots__}


def _view_from(values: dict) -> WorkerView:
    return WorkerView(
        worker_id=values["worker_id"], role=values["role"], model=values["model"],
        control_addr=values["control_addr"], kv_addr=values["kv_addr"],
        host_id=values["host_id"], block_size=int(values["block_size"]),
        num_blocks=int(values["num_blocks"]), fingerprint=values["fingerprint"],
        free_blocks=int(values.get("free_blocks", 0)))


async def serve(settings: ConductorSettings) -> None:
    conductor = Conductor(settings)
    await conductor.start()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await conductor.close()


def main(argv=None) -> int:
    from common.config import load_settings

    settings = load_settings(ConductorSettings, "conductor", argv)
    configure_logging(settings.log_format, service="conductor")
    install_uvloop()
    asyncio.run(serve(settings))
    return 0
