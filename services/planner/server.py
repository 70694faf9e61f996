"""The planner process (``pdserve planner``): look, decide, act, every ``interval_s``.

    every interval_s:
        GetStats -> conductor            no answer: log, count, skip this look
        for prefill, decode:
            count  = actuator.count(role)
            d      = Planner.decide(role, count, load of role, now)
            a change: log, count, actuator.scale(role, d.target)

It only reads the conductor (GetStats, which the ``client`` role's CURVE key may send),
so it needs no place in the control plane's message tables; it is one process beside the
conductor rather than a part of it so that a planner with the Kubernetes API's
credentials, or one that hangs in an actuator call, touches nothing on the request path.
Two planners must not act on the same workers: run one.

Every decision that changes a count, or that wanted to and could not (``at_max``,
``cooldown``), is logged with its figures and counted in
``pdserve:planner_decisions_total{role,action,reason}``; ``pdserve:planner_workers{role}``
is each role's count, ``pdserve:planner_errors_total{kind}`` the looks that failed
(``conductor``, ``actuator``). The actuator failing to start is exit 1; failing later is
logged and retried at the next look.
"""

from __future__ import annotations

import asyncio
import time

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from common.config import load_settings
from common.logging import configure_logging
from common.protocol import ConductorStats, GetStats
from common.service_main import run_service, until_stopped
from common.zmq_auth import make_context
from common.zmq_rpc import RemoteError, RpcClient, RpcTimeout
from services.planner.actuator import Actuator, ActuatorError
from services.planner.actuators import make_actuator
from services.planner.decide import HOLD, Decision, Planner
from services.planner.load import ROLES, role_loads
from services.planner.settings import PlannerSettings

log = structlog.get_logger(__name__)


class PlannerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.decisions = Counter(
            "pdserve:planner_decisions", "Scaling decisions that changed a role's count or "
            "were held back", ["role", "action", "reason"], registry=self.registry)
        self.workers = Gauge("pdserve:planner_workers", "Workers the actuator runs",
                             ["role"], registry=self.registry)
        self.errors = Counter("pdserve:planner_errors", "Looks that failed", ["kind"],
                              registry=self.registry)


class PlannerService:
    def __init__(self, settings: PlannerSettings, actuator: Actuator | None = None) -> None:
        self.settings = settings
        self.planner = Planner(settings)
        try:
            self.actuator = actuator or make_actuator(settings)
        except ActuatorError as exc:  # settings it cannot work with: a startup error
            raise ValueError(f"actuator {settings.actuator}: {exc}") from exc
        self.metrics = PlannerMetrics()
        self.ctx = make_context(settings.curve_keys_dir, "client")
        self.client = RpcClient(self.ctx, settings.conductor_addr, name="planner",
                                server="conductor")
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        try:
            await self.actuator.start()
        except ActuatorError as exc:
            raise ValueError(f"actuator {self.actuator.name}: {exc}") from exc
        if self.settings.metrics_port:
            start_http_server(self.settings.metrics_port, addr=self.settings.metrics_host,
                              registry=self.metrics.registry)
        self._task = asyncio.create_task(self._run())
        s = self.settings
        log.info("planner started", conductor=s.conductor_addr, actuator=self.actuator.name,
                 prefill=[s.min_prefill, s.max_prefill], decode=[s.min_decode, s.max_decode],
                 interval_s=s.interval_s)

    @property
    def loops(self) -> list[asyncio.Task]:
        return [self._task] if self._task else []

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.actuator.close()
        await self.client.close()
        self.ctx.term()

    async def _run(self) -> None:
        while True:
            started = time.monotonic()
            await self.look()
            await asyncio.sleep(max(0.0, self.settings.interval_s -
                                    (time.monotonic() - started)))

    async def look(self) -> list[Decision]:
        """One look at the conductor and one decision per role; the decisions made."""
        try:
            reply = await self.client.call(GetStats(), timeout=self.settings.stats_timeout_s)
            stats = reply.record
            if not isinstance(stats, ConductorStats):
                raise ValueError(f"answered with {reply.envelope.type}")
        except (RpcTimeout, RemoteError, ValueError) as exc:
            self.metrics.errors.labels(kind="conductor").inc()
            log.warning("no stats from the conductor", error=str(exc))
            return []
        loads = role_loads(stats, self.settings.model)
        decisions = []
        for role in ROLES:
            try:
                count = await self.actuator.count(role)
                decision = self.planner.decide(role, count, loads[role], time.monotonic())
                decisions.append(decision)
                self._record(decision, loads[role].alive)
                if decision.changes:
                    await self.actuator.scale(role, decision.target)
                    count = decision.target
                self.metrics.workers.labels(role=role).set(count)
            except ActuatorError as exc:
                self.metrics.errors.labels(kind="actuator").inc()
                log.error("actuator failed", role=role, actuator=self.actuator.name,
                          error=str(exc))
        return decisions

    def _record(self, d: Decision, alive: int) -> None:
        if d.action == HOLD and d.reason == "steady":
            return
        self.metrics.decisions.labels(role=d.role, action=d.action, reason=d.reason).inc()
        how = log.info if d.changes else log.debug
        how("planner decision", role=d.role, action=d.action, reason=d.reason,
            workers=d.current, target=d.target, alive=alive, detail=d.detail)


async def serve(settings: PlannerSettings, stop: asyncio.Event) -> None:
    service = PlannerService(settings)
    await service.start()
    try:
        await until_stopped(stop, service.loops)
    finally:
        await service.close()


def main(argv=None) -> int:
    return run_service(
        "planner", lambda: load_settings(PlannerSettings, "planner", argv), serve,
        prepare=lambda s: configure_logging(s.log_format, service="planner"))
