"""A model worker process: the engine in its role, on the control and data planes.

Startup: load the model, bind the control ROUTER (and, for decode roles, the KV
receiver), say Hello to the conductor (retrying until it answers), then heartbeat every
second with the engine's load. Requests arrive on the control socket; tokens leave on
PUSH sockets to the gateway named in each request.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import os
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

from common.address import format_address, parse_address
from common.config import apply_ucx_settings, load_settings
from common.logging import configure_logging
from common.protocol import (
    Abort,
    Ack,
    Error,
    Generate,
    GetStats,
    Heartbeat,
    HeldBlocks,
    Hello,
    KVAdvert,
    KVEvent,
    Prefill,
    Resync,
    TokenLogprob,
    TopLogprob,
    WorkerInfo,
    WorkerStats,
)
from common.service_main import run_service, until_stopped
from common.transfer import MultiReceiver, MultiSender, TransferError
from common.zmq_auth import make_context
from common.zmq_io import Publisher
from common.zmq_policy import WORKER_CONTROL
from common.zmq_rpc import RpcClient, RpcServer, RpcTimeout
from services.engine.core import NO_HOOKS, EngineHooks
from services.worker.decode_role import DecodeRole
from services.worker.engine_loop import EngineLoop
from services.worker.metrics import WorkerMetrics
from services.worker.pool_link import PoolLink
from services.worker.prefill_role import PrefillRole
from services.worker.settings import WorkerSettings, parse_cpus
from services.worker.token_streams import TokenStreams

if TYPE_CHECKING:
    from services.engine.core import EngineCore

log = structlog.get_logger(__name__)

KV_EVENT_FLUSH_S = 0.1  # how often prefix-cache changes go out to the conductor


def build_engine(s: WorkerSettings, hooks: EngineHooks = NO_HOOKS) -> EngineCore:
    """The executor ``s.executor`` names: the model (imports torch) or the simulation."""
    if s.executor == "sim":
        from common.cost_profile import load_profile
        from services.engine.sim import SimEngine

        return SimEngine(load_profile(s.sim_profile), block_size=s.block_size,
                         kv_cache_bytes=s.kv_cache_mib << 20, max_num_seqs=s.max_num_seqs,
                         max_num_batched_tokens=s.max_num_batched_tokens,
                         max_model_len=s.max_model_len or 8192, time_scale=s.sim_time_scale,
                         hooks=hooks)
    from services.engine.config import EngineConfig
    from services.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(
        model=s.model, dtype=s.dtype, block_size=s.block_size,
        kv_cache_bytes=s.kv_cache_mib << 20, max_model_len=s.max_model_len or None,
        max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
        num_threads=s.num_threads or None), hooks=hooks)


def advertise(addr: str, host: str = "") -> str:
    """``addr`` (``scheme://host:port``) as peers should dial it: with ``host`` when
    given, else with this machine's address in place of a wildcard bind. Addresses
    without a network host (shm, ipc) are returned as they are."""
    try:
        parsed = parse_address(addr)
    except ValueError:
        return addr
    if parsed.scheme not in ("tcp", "ucx"):
        return addr
    if not host and parsed.is_wildcard:
        host = socket.gethostbyname(socket.gethostname())
    return format_address(parsed.scheme, host, parsed.port) if host else addr


def pin_cpus(spec: str) -> None:
    """Pin this process (and the threads it starts later) to the CPUs in ``spec``."""
    cpus = parse_cpus(spec)
    if cpus:
        os.sched_setaffinity(0, cpus)
        log.info("pinned to CPUs", cpus=sorted(cpus))


class Worker:
    def __init__(self, settings: WorkerSettings,
                 make_engine: Callable[[EngineHooks], EngineCore]) -> None:
        self.settings = settings
        self.worker_id = settings.worker_id or (
            f"{settings.role}-{settings.resolved_host_id}-{os.getpid()}")
        self.ctx = make_context(settings.curve_keys_dir, settings.role)
        self.metrics = WorkerMetrics(self.worker_id, settings.role)
        # Prefix-cache changes, appended on the engine thread, published in batches.
        self._kv_events: collections.deque[tuple[str, list[int]]] = collections.deque()
        self.prefill = PrefillRole(self) if settings.role == "prefill" else None
        self.engine = engine = make_engine(EngineHooks(
            on_layer=self.prefill.on_layer if self.prefill else None,
            on_stored=lambda hashes: self._kv_events.append(("stored", hashes)),
            on_removed=lambda hashes: self._kv_events.append(("removed", hashes))))
        self.loop = EngineLoop(engine, self._on_outputs, name=self.worker_id)
        self.streams = TokenStreams(self.ctx)
        self.pool = PoolLink(self)
        self.decode = DecodeRole(self) if settings.role != "prefill" else None
        self.rpc = RpcServer(self.ctx, settings.control_addr, self._handle, name=self.worker_id,
                             allowed=WORKER_CONTROL)
        self.receiver = None
        forced = None if settings.transfer_backend == "auto" else settings.transfer_backend
        self.sender = MultiSender(host_id=settings.resolved_host_id, forced=forced) \
            if self.prefill else None
        self._clients: dict[str, RpcClient] = {}
        self._tasks: list[asyncio.Task] = []
        self.registered = asyncio.Event()

    # ---- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        self.loop.start()
        if self.decode is not None:  # before the control socket: stats name its address
            s = self.settings
            kinds = None if s.transfer_backend == "auto" else (s.transfer_backend,)
            self.receiver = MultiReceiver(kinds, host=s.kv_host, port=s.kv_port,
                                          sink=self.decode.on_kv_chunk,
                                          host_id=s.resolved_host_id)
            await self.receiver.start()
        await self.rpc.start()
        await self.pool.start()
        if self.settings.metrics_port:
            self.metrics.serve(self.settings.metrics_port)
        self._tasks.append(asyncio.create_task(self._register_and_beat()))
        log.info("worker started", worker_id=self.worker_id, role=self.settings.role,
                 control=self.control_addr, kv=self.kv_addr)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.rpc.close()
        await self.pool.close()
        for client in self._clients.values():
            await client.close()
        if self.receiver is not None:
            await self.receiver.close()
        if self.sender is not None:
            await self.sender.close()
        await self.streams.close()
        await self.loop.stop()
        self.ctx.term()

    @property
    def control_addr(self) -> str:
        """Where peers reach this worker's control socket (see ``advertise``)."""
        return advertise(self.rpc.address, self.settings.advertise_host)

    @property
    def kv_addr(self) -> str:
        if self.receiver is None:
            return ""
        return advertise(self.receiver.address, self.settings.advertise_host)

    def kv_advert(self) -> KVAdvert | None:
        """The receiver's advert, each network endpoint as peers reach it."""
        if self.receiver is None:
            return None
        advert = self.receiver.advert()
        return KVAdvert(host_id=advert.host_id,
                        endpoints={k: advertise(a, self.settings.advertise_host)
                                   for k, a in advert.endpoints.items()})

    def client(self, addr: str, server: str = "worker") -> RpcClient:
        client = self._clients.get(addr)
        if client is None:
            client = self._clients[addr] = RpcClient(self.ctx, addr, name=self.worker_id,
                                                     server=server)
        return client

    # ---- control plane ---------------------------------------------------------------

    async def _handle(self, msg):
        rec, rid = msg.record, msg.envelope.request_id
        if isinstance(rec, GetStats):
            return self.stats()
        if isinstance(rec, Resync):
            hashes = await self.loop.call(self.engine.block_manager.cached_hashes)
            return HeldBlocks(source=self.worker_id, hashes=list(hashes),
                              tiers=["local"] * len(hashes))
        if not rid and isinstance(rec, Generate | Prefill | Abort):
            return Error("bad_request", "request id missing from the envelope")
        if isinstance(rec, Generate):
            if self.decode is None:
                return Error("wrong_role", f"{self.worker_id} is a prefill worker")
            return await self.decode.handle(rid, rec)
        if isinstance(rec, Prefill):
            if self.prefill is None:
                return Error("wrong_role", f"{self.worker_id} does not run remote prefills")
            return await self.prefill.handle(rid, rec)
        if isinstance(rec, Abort):
            role = self.decode or self.prefill
            await role.abort(rid)
            return Ack(detail="aborted")
        return Error("unsupported", f"{type(rec).__name__} is not handled by a worker")

    def _on_outputs(self, outputs, step_s: float) -> None:
        self.metrics.step_seconds.observe(step_s)
        for out in outputs:
            if out.queue_time_s is not None:
                self.metrics.queue_time.observe(out.queue_time_s)
            if self.prefill is not None:
                self.prefill.on_output(out)
            else:
                self.decode.on_output(out)

    @staticmethod
    def logprob_records(logprobs) -> list[TokenLogprob]:
        return [TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank,
                             top=[TopLogprob(token_id=t, logprob=v) for t, v in lp.top])
                for lp in logprobs if lp is not None]

    def info(self, num_blocks: int) -> WorkerInfo:
        s = self.settings
        return WorkerInfo(worker_id=self.worker_id, role=s.role, model=s.model,
                          control_addr=self.control_addr, kv_addr=self.kv_addr,
                          host_id=s.resolved_host_id, block_size=s.block_size,
                          num_blocks=num_blocks, fingerprint=self.engine.fingerprint)

    def stats(self) -> WorkerStats:
        load = self.loop.load
        return WorkerStats(
            info=self.info(load.total_blocks), executor=self.settings.executor,
            free_blocks=load.free_blocks, waiting=load.waiting, running=load.running,
            num_requests=load.num_requests,
            live_transfers=self.receiver.live() if self.receiver is not None else 0,
            local_fallbacks=self.decode.local_fallbacks if self.decode else 0,
            kv_bytes_received=self.decode.received_bytes if self.decode else 0,
            kv_bytes_sent=self.prefill.sent_bytes if self.prefill else 0,
            prefills_done=self.prefill.done if self.prefill else 0,
            prefill_jobs=len(self.prefill.jobs) if self.prefill else 0,
            kv_chunks_resent=self.sender.resent if self.sender is not None else 0,
            kv_chunks_retried=self.receiver.retried if self.receiver is not None else 0,
            transfer_backends=dict(self.prefill.backends) if self.prefill else {},
            kv_advert=self.kv_advert(), pool=self.pool.stats())

    async def _register_and_beat(self) -> None:
        s = self.settings
        conductor = self.client(s.conductor_addr, "conductor")
        hello = Hello(info=self.info(self.engine.block_manager.num_blocks))
        while not self.registered.is_set():
            try:
                await conductor.call(hello, timeout=2.0)
                self.registered.set()
                log.info("registered with conductor", conductor=s.conductor_addr)
            except (RpcTimeout, Exception) as exc:  # keep trying until the conductor is up
                log.info("conductor not answering yet", error=str(exc) or type(exc).__name__)
                await asyncio.sleep(0.5)
        pub = Publisher(self.ctx, s.heartbeat_addr, bind=False, server="conductor")
        seq = 0
        next_beat = 0.0
        try:
            while True:
                await self._flush_kv_events(pub)
                now = asyncio.get_running_loop().time()
                if now < next_beat:
                    await asyncio.sleep(min(KV_EVENT_FLUSH_S, next_beat - now))
                    continue
                next_beat = now + s.heartbeat_interval_s
                load = self.loop.load
                self.metrics.update_load(load)
                prefill_steps, decode_steps = self.loop.take_samples()
                await pub.publish(Heartbeat(
                    worker_id=self.worker_id, role=s.role, seq=seq, waiting=load.waiting,
                    running=load.running, queued_prefill_tokens=load.queued_prefill_tokens,
                    free_blocks=load.free_blocks, total_blocks=load.total_blocks,
                    step_time_ms=self.loop.recent_step_ms(), control_addr=self.control_addr,
                    prefill_steps=prefill_steps, decode_steps=decode_steps))
                seq += 1
        finally:
            await pub.close()

    async def _flush_kv_events(self, pub: Publisher) -> None:
        """Publish the prefix-cache changes since the last flush, runs of one kind merged."""
        batch: list[tuple[str, list[int]]] = []
        while self._kv_events:
            kind, hashes = self._kv_events.popleft()
            if batch and batch[-1][0] == kind:
                batch[-1][1].extend(hashes)
            else:
                batch.append((kind, list(hashes)))
        for kind, hashes in batch:
            await pub.publish(KVEvent(source=self.worker_id, kind=kind, hashes=hashes),
                              topic=b"kv")


async def serve(settings: WorkerSettings, stop: asyncio.Event) -> None:
    # Loads the model on this thread: nothing else runs in the process yet.
    worker = Worker(settings, functools.partial(build_engine, settings))
    await worker.start()
    try:
        await until_stopped(stop, worker._tasks)
    finally:
        await worker.close()


def _load(argv, role: str | None) -> WorkerSettings:
    settings = load_settings(WorkerSettings, role or "worker", argv)
    return settings if role is None else dataclasses.replace(settings, role=role)


def _prepare(settings: WorkerSettings) -> None:
    configure_logging(settings.log_format, service=settings.role)
    apply_ucx_settings(settings.ucx_tls, settings.ucx_net_devices)
    pin_cpus(settings.cpu_affinity)


def main(argv=None, role: str | None = None) -> int:
    return run_service(role or "worker", lambda: _load(argv, role), serve, prepare=_prepare,
                       startup_errors=(TransferError,))
