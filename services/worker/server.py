"""A model worker process: the engine in its role, on the control and data planes.

Startup: load the model (on the engine thread, so that a stop meanwhile is obeyed at
once), bind the control ROUTER (and, for decode roles, the KV receiver), say Hello to
the conductor (retrying until it answers), then heartbeat every second with the
engine's load. A conductor that refuses the Hello (this worker's KV cannot be exchanged
with its model's other workers: ``services/worker/handshake.py``) stops the process,
exit 1, with the reason logged. Requests arrive on the control socket; tokens leave on
PUSH sockets to the gateway named in each request.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

from common.address import bind_host
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
    KVEvent,
    Leaving,
    Migrate,
    MigrateDone,
    Prefill,
    Resync,
    WorkerInfo,
    WorkerStats,
)
from common.service_main import run_service, until_stopped
from common.tracing import Tracer
from common.transfer import TransferError
from common.zmq_auth import make_context
from common.zmq_io import Publisher
from common.zmq_metrics import ControlMetrics
from common.zmq_policy import WORKER_CONTROL
from common.zmq_rpc import RemoteError, RpcClient, RpcServer, RpcTimeout
from services.engine.core import NO_HOOKS, EngineHooks
from services.worker.context import RoleContext, advertise
from services.worker.decode_role import DecodeRole
from services.worker.engine_loop import EngineLoop
from services.worker.handshake import (
    REFUSED_CODES,
    KVLayout,
    WorkerRefused,
    hash_and_version,
    kv_layout,
)
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
                         prefill_chunk_size=s.prefill_chunk_size or None,
                         max_prefill_tokens_with_decode=s.max_prefill_tokens_with_decode or None,
                         max_model_len=s.max_model_len or 8192, time_scale=s.sim_time_scale,
                         hooks=hooks)
    from services.engine.config import EngineConfig
    from services.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(
        model=s.model, dtype=s.dtype, device=s.device, attention_backend=s.attention_backend,
        block_size=s.block_size,
        kv_cache_bytes=s.kv_cache_mib << 20, max_model_len=s.max_model_len or None,
        max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
        prefill_chunk_size=s.prefill_chunk_size or None,
        max_prefill_tokens_with_decode=s.max_prefill_tokens_with_decode or None,
        num_threads=s.num_threads or None, quantization=s.quantization,
        kv_cache_dtype=s.kv_cache_dtype,
        tensor_parallel_size=s.tensor_parallel_size, cuda_graphs=s.use_cuda_graphs,
        random_weights=s.random_weights or None, seed=s.random_seed), hooks=hooks)


def pin_cpus(spec: str) -> None:
    """Pin this process (and the threads it starts later) to the CPUs in ``spec``."""
    cpus = parse_cpus(spec)
    if cpus:
        os.sched_setaffinity(0, cpus)
        log.info("pinned to CPUs", cpus=sorted(cpus))


class Worker:
    """The process's parts, wired: the engine on its loop, one role, the pool link, the
    control socket. The parts get a ``RoleContext``, never the worker."""

    def __init__(self, settings: WorkerSettings,
                 make_engine: Callable[[EngineHooks], EngineCore]) -> None:
        self.settings = settings
        self.worker_id = settings.worker_id or (
            f"{settings.role}-{settings.resolved_host_id}-{os.getpid()}")
        self.ctx = make_context(settings.curve_keys_dir, settings.role)
        self.metrics = WorkerMetrics(self.worker_id, settings.role)
        self.metrics.registry.register(ControlMetrics(self.ctx))
        self._clients: dict[str, RpcClient] = {}
        self._closing = False
        # Prefix-cache changes, appended on the engine thread, published in batches.
        self._kv_events: collections.deque[tuple[str, list[int]]] = collections.deque()
        self.loop = EngineLoop(self._on_outputs, name=self.worker_id)
        self.streams = TokenStreams(self.ctx)
        self.tracer = Tracer(settings.role, enabled=settings.tracing,
                             endpoint=settings.tracing_endpoint, file=settings.tracing_file)
        ctx = RoleContext(worker_id=self.worker_id, settings=settings, loop=self.loop,
                          streams=self.streams, metrics=self.metrics, zmq=self.ctx,
                          peer=self.client, tracer=self.tracer)
        self.pool = PoolLink(ctx)
        self.role: DecodeRole | PrefillRole = (
            PrefillRole(ctx, self.pool) if settings.role == "prefill"
            else DecodeRole(ctx, self.pool))
        self._build_engine = functools.partial(make_engine, EngineHooks(
            on_layer=self.role.on_layer if isinstance(self.role, PrefillRole) else None,
            on_stored=lambda hashes: self._kv_events.append(("stored", hashes)),
            on_removed=lambda hashes: self._kv_events.append(("removed", hashes))))
        self.rpc = RpcServer(self.ctx, settings.control_addr, self._handle, name=self.worker_id,
                             allowed=WORKER_CONTROL)
        self._tasks: list[asyncio.Task] = []
        self.registered = asyncio.Event()
        self.kv_layout: KVLayout | None = None  # read from the engine once it is built

    # ---- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Load the model (on the engine thread), then bind and register. A failure
        raises; ``close`` cleans up after a start that failed or was cancelled."""
        await self.loop.start(self._build_engine)
        self.kv_layout = await self.loop.run(kv_layout)
        tp_failed = await self.loop.run(lambda e: getattr(e, "tp_failed", None))
        if tp_failed is not None:
            self._tasks.append(asyncio.create_task(self._watch_tp(tp_failed),
                                                   name="tensor-parallel ranks"))
        await self.role.start()  # before the control socket: stats name its KV address
        await self.rpc.start()
        await self.pool.start()
        if self.settings.metrics_port:
            # Beside the control socket, on its host: not on every interface.
            self.metrics.serve(self.settings.metrics_port, bind_host(self.settings.control_addr))
        self._tasks.append(asyncio.create_task(self._register_and_beat()))
        log.info("worker started", worker_id=self.worker_id, role=self.settings.role,
                 control=self.control_addr, kv=self.role.kv_addr)

    async def hand_back(self) -> None:
        """A planned stop. The conductor is told first, so that it routes nothing more
        here. A decode worker moves its running requests with their KV to other decode
        workers (``migrate_on_stop``), and hands the rest back to their gateways, which
        continue them elsewhere (recomputing the KV); a prefill worker finishes the
        prefills in flight, within their KV lease."""
        try:
            await self.client(self.settings.conductor_addr, "conductor").call(
                Leaving(worker_id=self.worker_id), timeout=2.0)
        except (RpcTimeout, RemoteError, ConnectionError) as exc:
            log.warning("conductor not told of the stop", worker_id=self.worker_id,
                        error=str(exc))
        if isinstance(self.role, DecodeRole):
            moved, handed = await self.role.hand_back(self.settings.migrate_on_stop)
            await self.streams.flush(timeout_s=2.0)
            load = await self.loop.run(lambda e: (e.block_manager.num_free_blocks,
                                                  len(e.requests)))
            log.info("requests handed back", worker_id=self.worker_id, requests=handed,
                     moved_with_kv=moved, free_blocks=load[0], left_in_engine=load[1])
        else:
            left = await self.role.drain(self.settings.kv_lease_s)
            log.info("prefills drained", worker_id=self.worker_id, unfinished=left)

    @property
    def loops(self) -> list[asyncio.Task]:
        """The tasks that must run as long as the process serves (see ``until_stopped``)."""
        return list(self._tasks)

    async def close(self) -> None:
        self._closing = True  # no new peer connections from here (see ``client``)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.rpc.close()
        await self.pool.close()
        for client in self._clients.values():
            await client.close()
        await self.role.close()
        await self.streams.close()
        # Followers are killed at exit regardless; an engine still loading has none.
        with contextlib.suppress(Exception):
            if self.loop.built:
                async with asyncio.timeout(15):
                    await self.loop.run(lambda e: getattr(e, "close", lambda: None)())
        await self.loop.stop()
        self.tracer.close()
        # Whatever socket is still open (a task that outlived the stop) is closed now;
        # ``term`` alone would wait for it forever.
        self.ctx.destroy(linger=0)

    @property
    def control_addr(self) -> str:
        """Where peers reach this worker's control socket (see ``advertise``)."""
        return advertise(self.rpc.address, self.settings.advertise_host)

    def client(self, addr: str, server: str = "worker") -> RpcClient:
        client = self._clients.get(addr)
        if client is None:
            if self._closing:  # a task still running as we stop: no new socket
                raise ConnectionError(f"{self.worker_id} is closing")
            client = self._clients[addr] = RpcClient(self.ctx, addr, name=self.worker_id,
                                                     server=server)
        return client

    async def _watch_tp(self, failed) -> None:
        """Fail (and so end the process) once a tensor-parallel follower died: the
        engine cannot step again, and heartbeats must stop."""
        while not failed.is_set():
            await asyncio.sleep(0.2)
        raise RuntimeError("a tensor-parallel rank died; this worker cannot serve")

    # ---- control plane ---------------------------------------------------------------

    async def _handle(self, msg):
        rec, rid = msg.record, msg.envelope.request_id
        if isinstance(rec, GetStats):
            return self.stats()
        if isinstance(rec, Resync):
            hashes = list(await self.loop.run(lambda e: e.block_manager.cached_hashes()))
            return HeldBlocks(source=self.worker_id, hashes=hashes,
                              tiers=["local"] * len(hashes))
        if not rid and isinstance(rec, Generate | Prefill | Abort | Migrate | MigrateDone):
            return Error("bad_request", "request id missing from the envelope")
        if isinstance(rec, Generate):
            if not isinstance(self.role, DecodeRole):
                return Error("wrong_role", f"{self.worker_id} is a prefill worker")
            return await self.role.handle(rid, rec, msg.envelope.trace)
        if isinstance(rec, Migrate | MigrateDone):
            if not isinstance(self.role, DecodeRole):
                return Error("wrong_role", f"{self.worker_id} is a prefill worker")
            if isinstance(rec, Migrate):
                return await self.role.arrivals.offer(rid, rec, msg.envelope.trace)
            return await self.role.arrivals.done(rid, rec)
        if isinstance(rec, Prefill):
            if not isinstance(self.role, PrefillRole):
                return Error("wrong_role", f"{self.worker_id} does not run remote prefills")
            return await self.role.handle(rid, rec, msg.envelope.trace)
        if isinstance(rec, Abort):
            await self.role.abort(rid)
            return Ack(detail="aborted")
        return Error("unsupported", f"{type(rec).__name__} is not handled by a worker")

    def _on_outputs(self, outputs, step_s: float) -> None:
        self.metrics.step_seconds.observe(step_s)
        for out in outputs:
            if out.queue_time_s is not None:
                self.metrics.queue_time.observe(out.queue_time_s)
            self.role.on_output(out)

    def info(self) -> WorkerInfo:
        s, facts = self.settings, self.loop.facts
        return WorkerInfo(worker_id=self.worker_id, role=s.role, model=s.model,
                          control_addr=self.control_addr, kv_addr=self.role.kv_addr,
                          host_id=s.resolved_host_id, block_size=s.block_size,
                          num_blocks=facts.num_blocks, fingerprint=facts.fingerprint,
                          tp_size=s.tensor_parallel_size,
                          **(self.kv_layout._asdict() if self.kv_layout else {}),
                          **hash_and_version())

    def stats(self) -> WorkerStats:
        load = self.loop.load
        return self.role.report(WorkerStats(
            info=self.info(), executor=self.settings.executor,
            free_blocks=load.free_blocks, waiting=load.waiting, running=load.running,
            num_requests=load.num_requests, pool=self.pool.stats(),
            waiting_for_kv=load.waiting_for_kv, reserved_blocks=load.reserved_blocks))

    async def _register_and_beat(self) -> None:
        s = self.settings
        conductor = self.client(s.conductor_addr, "conductor")
        hello = Hello(info=self.info())
        while not self.registered.is_set():
            try:
                await conductor.call(hello, timeout=2.0)
                self.registered.set()
                log.info("registered with conductor", conductor=s.conductor_addr)
            except RemoteError as exc:
                if exc.code in REFUSED_CODES:
                    log.error("refused by the conductor", worker_id=self.worker_id,
                              code=exc.code, reason=exc.message)
                    raise WorkerRefused(f"refused by the conductor: {exc.message}") from None
                log.info("hello not accepted yet", error=str(exc))
                await asyncio.sleep(0.5)
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
                    prefill_steps=prefill_steps, decode_steps=decode_steps,
                    waiting_for_kv=load.waiting_for_kv, reserved_blocks=load.reserved_blocks,
                    ttft_samples=(self.role.take_ttft_samples()
                                  if isinstance(self.role, DecodeRole) else []),
                    admitted=self.loop.take_admitted(load)))
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
    worker = Worker(settings, functools.partial(build_engine, settings))
    starting = asyncio.ensure_future(worker.start())
    stopping = asyncio.ensure_future(stop.wait())
    try:
        # A stop during a long model load is obeyed at once; the load is left behind
        # on its daemon thread.
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            log.info("stopped while starting", worker_id=worker.worker_id)
            return
        starting.result()  # a failure to start raises here
        await until_stopped(stop, worker.loops)
        await worker.hand_back()  # a stop asked for (SIGTERM): not after a failure
    finally:
        starting.cancel()
        stopping.cancel()
        await worker.close()


def _load(argv, role: str | None) -> WorkerSettings:
    settings = load_settings(WorkerSettings, role or "worker", argv)
    return settings if role is None else dataclasses.replace(settings, role=role)


def _prepare(settings: WorkerSettings) -> None:
    configure_logging(settings.log_format, service=settings.role,
                      level=settings.log_level.upper())
    apply_ucx_settings(settings.ucx_tls, settings.ucx_net_devices)
    pin_cpus(settings.cpu_affinity)


def main(argv=None, role: str | None = None) -> int:
    return run_service(role or "worker", lambda: _load(argv, role), serve, prepare=_prepare,
                       startup_errors=(TransferError,))
