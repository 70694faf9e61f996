"""The conductor process: worker registry, liveness, and routing.

Workers say Hello on the control socket and heartbeat on a SUB socket the conductor
binds. A heartbeat from a worker the conductor does not know (it restarted) makes it ask
that worker for its details, so the registry rebuilds itself within a heartbeat or two.
A worker silent for three heartbeat intervals is dead and receives no more requests.

Routing is ``services/conductor/router.py`` (default policy "cache_aware"): its cost
model starts from the ``cost_profile`` calibration and is refitted from the step
timings in every heartbeat. Each Route is answered with RouteReply, or with
``Error("overloaded", reason, retry_after_s)`` when admission predicts an SLO miss, or
``Error("unavailable")`` when no live worker serves the model. Every decision is
logged with its reason and counted in ``pdserve:routing_decisions{outcome}``
(``remote``, ``local``, ``colocated``, ``rejected``).

A Hello is checked first (``services/conductor/compat.py``): a worker whose KV cannot be
exchanged with its model's others (block size, block hash, KV dtype or layout, protocol
version, fingerprint) is answered ``Error("incompatible", reason)``, logged, counted in
``pdserve:workers_refused{reason}`` and listed in ``refused`` of ConductorStats and
WorkerList; the worker exits, and the conductor goes on serving with the others.

The prefix index is fed by the workers' KV events (on the heartbeat socket, with a
Resync of a worker the conductor rediscovers) and, with ``cache_pools`` set, by the
cache-pool instances' own event sockets (``services/conductor/pool_watch.py``).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from common.address import bind_host
from common.config import load_settings
from common.cost_profile import load_profile
from common.logging import configure_logging
from common.pool.discovery import parse_pool_addrs
from common.protocol import (
    Ack,
    ConductorStats,
    Error,
    GetStats,
    Heartbeat,
    HeldBlocks,
    Hello,
    KVEvent,
    Leaving,
    ListWorkers,
    Resync,
    Route,
    RouteReply,
    Welcome,
    WorkerList,
    WorkerStats,
)
from common.service_main import run_service, until_stopped
from common.tracing import Tracer
from common.zmq_auth import make_context
from common.zmq_io import Subscriber
from common.zmq_metrics import ControlMetrics
from common.zmq_policy import CONDUCTOR_CONTROL, CONDUCTOR_EVENTS
from common.zmq_rpc import RpcClient, RpcServer
from services.conductor.cache_policy import Rejection
from services.conductor.metrics import CorrectionMetrics, reason_class
from services.conductor.policy import NoWorkers
from services.conductor.pool_watch import PoolWatch
from services.conductor.registry import Registry, WorkerView
from services.conductor.router import Router, RouterConfig, RouteRequest
from services.conductor.ttft_correction import CorrectionConfig

log = structlog.get_logger(__name__)

# A Route's prompt and output lengths are held to this (16 Mi tokens, beyond any model's
# context): admitted, a length of 2**63 counted in its decode worker's predicted load
# until the decision expired (``inflight_ttl_s``), and every TBT check there failed.
MAX_ROUTE_TOKENS = 1 << 24


@dataclass(frozen=True, slots=True)
class ConductorSettings:
    control_addr: str = "tcp://127.0.0.1:5551"
    heartbeat_addr: str = "tcp://127.0.0.1:5552"
    heartbeat_interval_s: float = 1.0
    policy: str = "cache_aware"  # or "least_loaded", "round_robin"
    cost_profile: str = "smollm2-cpu"  # calibration: a name in deploy/profiles or a path
    # Baseline policies: prompts with fewer uncached tokens prefill on decode.
    disagg_threshold: int = 256
    slo_ttft_ms: float = 0.0  # default SLOs for requests that set none; 0: none
    slo_tbt_ms: float = 0.0
    admission: bool = True  # reject at arrival when the predicted TTFT/TBT misses the SLO
    max_decode_stall_s: float = 0.5  # cap on a local prefill's stall of running decodes
    planned_output_tokens: int = 512  # output planned for when max_tokens is larger
    kv_lease_s: float = 10.0  # the workers' kv_lease_s: a longer remote prefill falls back
    # TTFT correction (services/conductor/ttft_correction.py, docs/configuration.md):
    # predictions scaled by the observed/predicted ratio decode workers report.
    ttft_correction: bool = True
    ttft_correction_min_samples: int = 5  # per worker (else its path's) before use
    ttft_correction_quantile: float = 0.9  # of the last 32 ratios
    ttft_correction_max_ratio: float = 4.0  # ratios clamped to [1/this, this]
    ttft_margin: float = 1.0  # admission refuses when corrected TTFT x this > SLO
    # Cache-pool control addresses, comma-separated (as the workers'); "": no pool.
    cache_pools: str = ""
    pool_check_interval_s: float = 1.0  # how often each pool instance is asked for Stats
    pool_dead_after_s: float = 5.0  # silent this long: its blocks leave the index
    metrics_port: int = 0
    log_format: str = "json"
    curve_keys_dir: str = ""  # CURVE keys (pdserve keys); empty: plain, trusted host only
    tracing: bool = False  # OpenTelemetry spans (docs/tracing.md)
    tracing_endpoint: str = ""  # OTLP/HTTP collector
    tracing_file: str = ""  # spans as JSON lines

    def __post_init__(self) -> None:
        if not (self.pool_check_interval_s > 0 and self.pool_dead_after_s > 0):
            raise ValueError("pool_check_interval_s and pool_dead_after_s must be > 0")

    def router_config(self) -> RouterConfig:
        return RouterConfig(
            policy=self.policy, disagg_threshold=self.disagg_threshold,
            slo_ttft_s=self.slo_ttft_ms / 1e3 if self.slo_ttft_ms > 0 else math.inf,
            slo_tbt_s=self.slo_tbt_ms / 1e3 if self.slo_tbt_ms > 0 else math.inf,
            admission=self.admission, max_decode_stall_s=self.max_decode_stall_s,
            planned_output_tokens=self.planned_output_tokens, kv_lease_s=self.kv_lease_s,
            correction=CorrectionConfig(
                enabled=self.ttft_correction, min_samples=self.ttft_correction_min_samples,
                quantile=self.ttft_correction_quantile,
                max_ratio=self.ttft_correction_max_ratio, margin=self.ttft_margin))


class Conductor:
    def __init__(self, settings: ConductorSettings) -> None:
        self.settings = settings
        self.router = Router(settings.router_config(), load_profile(settings.cost_profile))
        self.ctx = make_context(settings.curve_keys_dir, "conductor")
        self.tracer = Tracer("conductor", enabled=settings.tracing,
                             endpoint=settings.tracing_endpoint, file=settings.tracing_file)
        # A decision no heartbeat acknowledges stops counting a KV lease after it: a
        # Prefill reaches its prefill worker within the lease or not at all.
        self.registry = Registry(settings.heartbeat_interval_s, settings.kv_lease_s)
        self.rpc = RpcServer(self.ctx, settings.control_addr, self._handle, name="conductor",
                             allowed=CONDUCTOR_CONTROL)
        self.sub = Subscriber(self.ctx, settings.heartbeat_addr, bind=True,
                              allowed=CONDUCTOR_EVENTS)
        self._tasks: list[asyncio.Task] = []
        self._discovering: set[str] = set()
        pools = parse_pool_addrs(settings.cache_pools)
        self.pools = PoolWatch(
            self.ctx, pools, self.router.index, self.apply_kv_event,
            check_interval_s=settings.pool_check_interval_s,
            dead_after_s=settings.pool_dead_after_s) if pools else None
        self.metrics = CollectorRegistry()
        self.metrics.register(ControlMetrics(self.ctx))
        self.metrics.register(CorrectionMetrics(self.router.correction))
        self.decisions = Counter("pdserve:routing_decisions", "Routing decisions",
                                 ["outcome"], registry=self.metrics)
        self.reasons = Counter("pdserve:routing_reasons", "Routing decisions by the kind of "
                               "reason (services/conductor/metrics.py)", ["outcome", "reason"],
                               registry=self.metrics)
        self.decision_seconds = Histogram(
            "pdserve:routing_decision_seconds", "Time to make one routing decision",
            registry=self.metrics, buckets=(2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 5e-3))
        self.refused_workers = Counter(
            "pdserve:workers_refused", "Workers refused at handshake, by the field that differs",
            ["reason"], registry=self.metrics)
        self.alive_workers = Gauge("pdserve:workers_alive", "Live workers", ["role"],
                                   registry=self.metrics)
        self.refused_heartbeats = Counter(
            "pdserve:heartbeats_refused", "Heartbeats whose load figures cannot be true, "
            "not applied (registry.heartbeat_problem)", registry=self.metrics)

    async def start(self) -> None:
        await self.rpc.start()
        self._tasks += [asyncio.create_task(self._heartbeats()),
                        asyncio.create_task(self._reaper())]
        if self.pools is not None:
            self._tasks.append(asyncio.create_task(self.pools.run()))
        if self.settings.metrics_port:
            start_http_server(self.settings.metrics_port, registry=self.metrics,
                              addr=bind_host(self.settings.control_addr))
        log.info("conductor started", control=self.rpc.address,
                 heartbeats=self.settings.heartbeat_addr, policy=self.router.name,
                 cost_profile=self.router.profile.name,
                 cache_pools=self.pools.control_addrs if self.pools else [])

    @property
    def loops(self) -> list[asyncio.Task]:
        """The tasks that must run as long as the process serves (see ``until_stopped``)."""
        return list(self._tasks)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.pools is not None:
            await self.pools.close()
        await self.rpc.close()
        await self.sub.close()
        self.tracer.close()
        self.ctx.term()

    async def _handle(self, msg):
        rec = msg.record
        if isinstance(rec, Hello):
            refused = self._admit(WorkerView(info=rec.info))
            if refused is not None:
                return Error("incompatible", refused)
            # A worker saying Hello starts with an empty cache: forget what it held.
            self.router.index.drop_location(rec.info.worker_id)
            return Welcome(conductor_id="conductor",
                           heartbeat_interval_s=self.settings.heartbeat_interval_s)
        if isinstance(rec, Leaving):
            return Ack(detail="" if self.registry.leave(rec.worker_id) else "unknown")
        if isinstance(rec, Route):
            span = self.tracer.span("conductor.route", msg.envelope.trace,
                                    {"prompt_len": rec.prompt_len})
            reply = self._route(rec, msg.envelope.request_id)
            for key, value in ({"decode_id": reply.decode_id, "reason": reply.reason,
                                "prefill_id": reply.prefill_id or ""}
                               if isinstance(reply, RouteReply)
                               else {"error": reply.code, "reason": reply.message}).items():
                span.set(key, value)
            span.end()
            return reply
        if isinstance(rec, ListWorkers):
            return WorkerList(workers=[w.status() for w in self.registry.workers.values()
                                       if not rec.model or w.model == rec.model],
                              refused=self.registry.refusals(rec.model))
        if isinstance(rec, GetStats):
            return self.stats()
        return Error("unsupported", f"{type(rec).__name__} is not handled by the conductor")

    def _admit(self, view: WorkerView) -> str | None:
        """Register ``view``; or, if its KV cannot be exchanged with its model's other
        workers, log and count that and return the reason."""
        found = self.registry.admit(view)
        if found is None:
            return None
        self.refused_workers.labels(reason=found.field).inc()
        log.error("worker refused", worker_id=view.worker_id, role=view.role,
                  model=view.model, field=found.field, reason=found.reason)
        return found.reason

    def stats(self) -> ConductorStats:
        cost = self.router.cost
        return ConductorStats(
            workers=[w.status() for w in self.registry.workers.values()],
            policy=self.router.name, cost_profile=self.router.profile.name,
            cost_model=cost.coefficients(),
            cost_observations=list(cost.observations),
            bad_samples=self.router.bad_samples, index_blocks=len(self.router.index),
            index_locations=self.router.index.counts(),
            cache_pools=self.pools.stats() if self.pools is not None else [],
            refused=self.registry.refusals(), contention=list(cost.contention))

    def _route(self, rec: Route, rid: str | None):
        for name in ("prompt_len", "max_tokens"):
            value = getattr(rec, name)
            if not 0 <= value <= MAX_ROUTE_TOKENS:
                return Error("invalid", f"{name} must be in [0, {MAX_ROUTE_TOKENS}], got {value}")
        for name in ("slo_ttft_ms", "slo_tbt_ms"):
            value = getattr(rec, name)
            if value is not None and not value > 0:  # inf: no target
                return Error("invalid", f"{name} must be > 0, got {value}")
        req = RouteRequest(
            model=rec.model, prompt_len=rec.prompt_len, block_hashes=rec.block_hashes,
            exclude=frozenset(rec.exclude),
            slo_ttft_s=None if rec.slo_ttft_ms is None else rec.slo_ttft_ms / 1e3,
            slo_tbt_s=None if rec.slo_tbt_ms is None else rec.slo_tbt_ms / 1e3,
            max_tokens=rec.max_tokens)
        start = time.perf_counter()
        try:
            decision = self.router.route(list(self.registry.workers.values()), req, rid)
        except NoWorkers as exc:
            return Error("unavailable", str(exc))
        except ValueError as exc:
            return Error("invalid", str(exc))
        finally:
            self.decision_seconds.observe(time.perf_counter() - start)
        if isinstance(decision, Rejection):
            self.decisions.labels(outcome="rejected").inc()
            self.reasons.labels(outcome="rejected", reason=reason_class(decision.reason)).inc()
            log.info("rejected", request_id=rid, reason=decision.reason,
                     retry_after_s=decision.retry_after_s)
            return Error("overloaded", decision.reason, retry_after_s=decision.retry_after_s)
        p = decision.prefill
        outcome = "remote" if p else (
            "colocated" if decision.decode.role == "unified" else "local")
        self.decisions.labels(outcome=outcome).inc()
        self.reasons.labels(outcome=outcome, reason=reason_class(decision.reason)).inc()
        log.info("routed", request_id=rid, decode=decision.decode.worker_id,
                 prefill=p.worker_id if p else None, reason=decision.reason)
        return RouteReply(decode_id=decision.decode.worker_id,
                          decode_addr=decision.decode.control_addr,
                          prefill_id=p.worker_id if p else None,
                          prefill_addr=p.control_addr if p else None, reason=decision.reason)

    def apply_heartbeat(self, hb: Heartbeat) -> bool:
        """Update the registry and fit the cost model; False for an unknown worker (whom
        the conductor then asks for its details)."""
        try:
            known = self.registry.heartbeat(hb)
        except ValueError as exc:  # a broken worker: left to age out, loudly
            self.refused_heartbeats.inc()
            log.warning("heartbeat refused", worker_id=hb.worker_id, reason=str(exc))
            return True
        if known:
            # The router's fitting reads samples as mappings (it also takes them from
            # the simulator and tests), so the records are handed over as such.
            self.router.observe(hb.prefill_steps, hb.decode_steps, hb.worker_id,
                                list(self.registry.workers.values()))
            if hb.ttft_samples:
                self.router.observe_ttft(hb.worker_id, hb.ttft_samples)
            return True
        # A refused worker is not asked again: only a Hello (a new process) can admit it.
        wid = hb.worker_id
        if hb.control_addr and wid not in self._discovering and wid not in self.registry.refused:
            self._discovering.add(wid)
            asyncio.create_task(self._discover(hb))
        return False

    async def _heartbeats(self) -> None:
        while True:
            msg = await self.sub.recv()
            if isinstance(msg.record, Heartbeat):
                self.apply_heartbeat(msg.record)
            elif isinstance(msg.record, KVEvent):
                self.apply_kv_event(msg.record)

    def apply_kv_event(self, event: KVEvent) -> None:
        """Keep the global prefix index in step with a worker's or pool's cache."""
        self.router.index.apply(event.source, event.kind, event.hashes)

    async def _resync(self, worker_id: str, control_addr: str) -> None:
        """Rebuild a worker's part of the prefix index from the blocks it reports."""
        client = RpcClient(self.ctx, control_addr, name="conductor", server="worker")
        try:
            reply = await client.call(Resync(), timeout=5.0)
            if not isinstance(reply.record, HeldBlocks):
                raise ValueError(f"answered with {reply.envelope.type}")
            hashes = reply.record.hashes
            self.router.index.drop_location(worker_id)
            self.router.index.stored(worker_id, hashes)
            log.info("prefix index resynced", worker_id=worker_id, blocks=len(hashes))
        except Exception as exc:
            log.warning("resync failed", worker_id=worker_id, error=str(exc))
        finally:
            await client.close()

    async def _discover(self, hb: Heartbeat) -> None:
        """Learn about a worker from its heartbeat (after a conductor restart)."""
        client = RpcClient(self.ctx, hb.control_addr, name="conductor", server="worker")
        try:
            reply = await client.call(GetStats(), timeout=2.0)
            stats = reply.record
            if not isinstance(stats, WorkerStats):
                raise ValueError(f"answered with {reply.envelope.type}")
            if self._admit(WorkerView(info=stats.info, free_blocks=stats.free_blocks)):
                return  # registered before this conductor started, refused now
            self.apply_heartbeat(hb)  # a heartbeat that cannot be true: refused, counted
            await self._resync(hb.worker_id, hb.control_addr)
        except Exception as exc:
            log.warning("could not reach worker", worker_id=hb.worker_id, error=str(exc))
        finally:
            self._discovering.discard(hb.worker_id)
            await client.close()

    async def _reaper(self) -> None:
        while True:
            await asyncio.sleep(min(0.25, self.settings.heartbeat_interval_s / 2))
            for worker_id in self.registry.reap():
                self.router.index.drop_location(worker_id)  # its cache died with it
                self.router.correction.forget(worker_id)
            for role in ("prefill", "decode", "unified"):
                self.alive_workers.labels(role=role).set(len(self.registry.alive((role,))))


async def serve(settings: ConductorSettings, stop: asyncio.Event) -> None:
    conductor = Conductor(settings)
    await conductor.start()
    try:
        await until_stopped(stop, conductor.loops)
    finally:
        await conductor.close()


def main(argv=None) -> int:
    return run_service(
        "conductor", lambda: load_settings(ConductorSettings, "conductor", argv), serve,
        prepare=lambda s: configure_logging(s.log_format, service="conductor"))
