"""What the gateway asks the conductor: the worker list (liveness, KV layout, refused
workers) and routes.

Each Route carries the prompt's block hashes (``common/block_hash.py``), for which the
gateway needs the workers' KV layout (model fingerprint and block size). It reads it
from the conductor's worker list (ListWorkers) and keeps it ``layout_ttl_s`` seconds;
with no live worker of the model known yet, a Route goes without hashes. The request's
SLOs and ``max_tokens`` go along. The conductor's ``overloaded`` becomes
``BackendOverloaded`` (HTTP 429, Retry-After from its ``retry_after_s``), its
``unavailable`` (no live decode worker) ``NoDecodeWorker``, which a caller may wait out.
"""

from __future__ import annotations

import math
import time

import zmq.asyncio

from common.block_hash import hash_blocks
from common.protocol import ListWorkers, Route, RouteReply, WorkerList, WorkerStatus
from common.zmq_rpc import RemoteError, RpcClient, RpcTimeout
from services.gateway.backend import BackendOverloaded, BackendUnavailable, GenerationRequest
from services.gateway.failover import NoDecodeWorker, listed_alive
from services.gateway.request_trace import RequestTrace


class ConductorLink:
    def __init__(self, ctx: zmq.asyncio.Context, conductor_addr: str, model: str, *,
                 rpc_timeout_s: float = 10.0, layout_ttl_s: float = 10.0) -> None:
        self.model = model
        self.rpc = RpcClient(ctx, conductor_addr, name="gateway", server="conductor")
        self.rpc_timeout_s = rpc_timeout_s
        self.layout_ttl_s = layout_ttl_s
        self._layout: tuple[str, int] | None = None  # (fingerprint, block size)
        self._layout_at = -float("inf")
        self._refused: list[dict[str, str]] = []  # as the conductor last listed them

    async def close(self) -> None:
        await self.rpc.close()

    async def workers(self) -> list[WorkerStatus] | None:
        """The conductor's list of workers; None if it does not answer."""
        try:
            reply = await self.rpc.call(ListWorkers(), timeout=2.0)
        except (RpcTimeout, RemoteError):
            return None
        if not isinstance(reply.record, WorkerList):
            return None
        self._refused = [{"worker_id": r.worker_id, "reason": r.reason}
                         for r in reply.record.refused if r.model == self.model]
        return reply.record.workers

    def refused(self) -> list[dict[str, str]]:
        """Workers of this model the conductor turned away, and why (last list seen)."""
        return self._refused

    async def any_decode_alive(self) -> bool:
        workers = await self.workers() or []
        return any(w.alive and w.info.role in ("decode", "unified") for w in workers)

    async def decode_alive(self, worker_id: str, addr: str) -> bool:
        workers = await self.workers()
        if workers is None:
            return True  # cannot tell: keep waiting rather than duplicate work
        return listed_alive(workers, worker_id, addr)

    async def kv_layout(self) -> tuple[str, int] | None:
        """(fingerprint, block size) of this model's workers, as the conductor lists them."""
        now = time.monotonic()
        if now - self._layout_at < self.layout_ttl_s:
            return self._layout
        workers = await self.workers()
        if workers is None:
            return self._layout
        layout = next(((w.info.fingerprint, w.info.block_size) for w in workers
                       if w.alive and w.info.model == self.model
                       and w.info.role in ("decode", "unified")), None)
        if layout is not None:  # none yet: ask again next time
            self._layout, self._layout_at = layout, now
        return self._layout

    async def _block_hashes(self, prompt: list[int], salt: str | None) -> list[int]:
        layout = await self.kv_layout()
        return [] if layout is None else hash_blocks(prompt, layout[1], layout[0], salt)

    async def route(self, req: GenerationRequest, prompt: list[int], resumed: bool,
                    max_tokens: int, exclude: list[str], trace: RequestTrace) -> RouteReply:
        # A resumed stream was admitted once already: no SLO may turn it away now.
        slo_ttft, slo_tbt = (math.inf, math.inf) if resumed else (req.slo_ttft_ms, req.slo_tbt_ms)
        started, route = trace.route_started(), None
        try:
            route = (await self.rpc.call(
                Route(model=self.model, prompt_len=len(prompt), exclude=exclude,
                      block_hashes=await self._block_hashes(prompt, req.cache_salt),
                      slo_ttft_ms=slo_ttft, slo_tbt_ms=slo_tbt, max_tokens=max_tokens),
                request_id=req.request_id, timeout=self.rpc_timeout_s,
                trace=trace.traceparent)).record
            return route
        except RemoteError as exc:
            if exc.code == "overloaded":
                raise BackendOverloaded(exc.message, exc.retry_after_s or 1.0) from exc
            if exc.code == "invalid":
                raise ValueError(exc.message) from exc
            raise (NoDecodeWorker if exc.code == "unavailable"
                   else BackendUnavailable)(exc.message) from exc
        except RpcTimeout as exc:
            raise BackendUnavailable("the conductor did not answer") from exc
        finally:
            trace.routed(started, route)
