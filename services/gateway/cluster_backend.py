"""The gateway's way to the cluster: route with the conductor, generate on a decode worker,
and gather the token stream that prefill (position 0) and decode (1, 2, …) push back.

Tokens of one request come from two processes over two sockets, so they may arrive out
of order; they are released strictly by position. A position seen twice (a decode worker
that fell back to local prefill re-sends token 0) is released once.

If a decode worker goes quiet and the conductor no longer lists it alive, or it hands the
request back because it is stopping (``WORKER_LEAVING``), the request is re-routed to
another decode worker with the prompt plus the tokens already streamed, and the client's
stream continues from where it stopped (``failover.py``: how, and how long it waits for
a live decode worker; a new request, which the conductor has none for, waits less).
A new request whose first ``Generate`` fails is re-routed the same way.
A stream moved with its KV by a stopping worker (``StreamMoved``) follows the new one.

Routing and the worker list: ``conductor_link.py``. An ``overloaded`` error, the
conductor's or a decode worker's (its queue is full), becomes ``BackendOverloaded``
(HTTP 429, Retry-After from its ``retry_after_s``).

A request that ends without its final event (the consumer cancelled or closed the
stream, a timeout, a ``Generate`` that timed out after the worker may have admitted it)
is aborted on its decode worker, which passes the abort on to the prefill worker. The
abort is sent from a task of its own, so a cancelled consumer cannot cancel it too.
If the token dispatcher dies, every waiting request ends with an error event at once
and ``ready`` is False: the process is about to go down.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import structlog
import zmq.asyncio

from common.protocol import (
    WORKER_LEAVING,
    Abort,
    Generate,
    RouteReply,
    SamplingParams,
    StreamMoved,
    Tokens,
)
from common.tracing import NO_TRACER, Tracer
from common.zmq_io import PullSocket
from common.zmq_policy import GATEWAY_STREAM
from common.zmq_rpc import RemoteError, RpcClient, RpcTimeout
from services.gateway.backend import (
    BackendOverloaded,
    BackendUnavailable,
    GenerationBackend,
    GenerationRequest,
)
from services.gateway.conductor_link import ConductorLink
from services.gateway.failover import (
    FailoverSettings,
    LostWorkers,
    SubmitFailed,
    attempt_id,
    moved_route,
    remaining_tokens,
    wait_for_route,
)
from services.gateway.request_trace import RequestTrace
from services.gateway.token_order import release_in_order

log = structlog.get_logger(__name__)


class ClusterBackend(GenerationBackend):
    def __init__(self, ctx: zmq.asyncio.Context, conductor_addr: str, stream_bind: str,
                 model: str, *, stream_advertise: str = "", rpc_timeout_s: float = 10.0,
                 stall_check_s: float = 2.0, failover: FailoverSettings | None = None,
                 layout_ttl_s: float = 10.0, tracer: Tracer = NO_TRACER) -> None:
        self.ctx = ctx
        self.tracer = tracer
        self.model = model
        self.conductor = ConductorLink(ctx, conductor_addr, model, rpc_timeout_s=rpc_timeout_s,
                                       layout_ttl_s=layout_ttl_s)
        self.pull = PullSocket(ctx, stream_bind, bind=True, allowed=GATEWAY_STREAM)
        self._advertise = stream_advertise
        self.rpc_timeout_s = rpc_timeout_s
        self.stall_check_s = stall_check_s
        self.failover = failover or FailoverSettings()
        self.queues: dict[str, asyncio.Queue] = {}  # by the id the worker sees
        self._running: set[str] = set()  # request ids, from arrival to the end
        # request id → (decode worker control address, the id it knows the request by)
        self.decoders: dict[str, tuple[str, str]] = {}
        self._clients: dict[str, RpcClient] = {}
        self._task: asyncio.Task | None = None
        self._aborts: set[asyncio.Task] = set()  # aborts in flight, kept from the GC

    @property
    def stream_addr(self) -> str:
        return self._advertise or self.pull.address

    async def start(self) -> None:
        self._task = asyncio.create_task(self._dispatch())
        self._task.add_done_callback(self._dispatch_ended)

    @property
    def loops(self) -> list[asyncio.Task]:
        """The token dispatcher, which must run as long as the gateway serves."""
        return [self._task] if self._task is not None else []

    @property
    def dispatching(self) -> bool:
        return self._task is not None and not self._task.done()

    def _dispatch_ended(self, _: asyncio.Task) -> None:
        # No more tokens will arrive: wake every waiting request instead of leaving it
        # to its timeout (which would also hold the HTTP server's shutdown).
        for q in self.queues.values():
            q.put_nowait(_STREAM_LOST)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._aborts:
            await asyncio.wait(self._aborts, timeout=self.rpc_timeout_s)
        for client in self._clients.values():
            await client.close()
        await self.conductor.close()
        await self.pull.close()

    def _client(self, addr: str) -> RpcClient:
        client = self._clients.get(addr)
        if client is None:
            client = self._clients[addr] = RpcClient(self.ctx, addr, name="gateway",
                                                     server="worker")
        return client

    async def _dispatch(self) -> None:
        while True:
            msg = await self.pull.recv()
            rid = msg.envelope.request_id
            q = self.queues.get(rid) if rid else None
            if q is not None and isinstance(msg.record, Tokens | StreamMoved):
                q.put_nowait(msg.record)
            elif rid and isinstance(msg.record, StreamMoved):  # moved after we let go
                self._abort_soon(msg.record.control_addr, rid)  # (failed over meanwhile)

    def refused(self) -> list[dict[str, str]]:
        return self.conductor.refused()

    async def ready(self) -> bool:
        return self.dispatching and await self.conductor.any_decode_alive()

    async def _start(self, req: GenerationRequest, generated: list[int],
                     exclude: list[str], wire_id: str, trace: RequestTrace) -> RouteReply:
        """Route and submit under ``wire_id``; returns the route taken. A failed
        ``Generate`` raises ``SubmitFailed`` (a BackendUnavailable) naming the worker."""
        prompt = req.prompt_token_ids + generated
        route = await self.conductor.route(req, prompt, bool(generated),
                                           remaining_tokens(req.sampling, len(generated)),
                                           exclude, trace)
        self.decoders[req.request_id] = (route.decode_addr, wire_id)
        try:
            await self._client(route.decode_addr).call(Generate(
                prompt_token_ids=prompt, sampling=SamplingParams.from_dict(req.sampling),
                stream_addr=self.stream_addr,
                prefill_id=route.prefill_id, prefill_addr=route.prefill_addr,
                cache_salt=req.cache_salt, start_position=len(generated)),
                request_id=wire_id, timeout=self.rpc_timeout_s, trace=trace.traceparent)
        except RemoteError as exc:
            if exc.code == "bad_request":
                raise ValueError(exc.message) from exc
            if exc.code == "overloaded":  # its queue is full: admitted nothing
                self.decoders.pop(req.request_id, None)
                raise BackendOverloaded(exc.message, exc.retry_after_s or 1.0) from exc
            raise SubmitFailed(exc.message, route) from exc
        except (RpcTimeout, ConnectionError) as exc:
            raise SubmitFailed(f"decode worker {route.decode_id} did not answer", route) from exc
        return route

    def _pass_over(self, exc: SubmitFailed, lost: LostWorkers, rid: str, wire: str) -> None:
        """After a failed ``Generate``: the worker is lost to this request (Route will
        exclude it), and aborted, in case it admitted the request after all."""
        lost.attempts += 1  # so ``wire`` is not used again
        self.queues.pop(wire, None)
        self.decoders.pop(rid, None)
        self._abort_soon(exc.route.decode_addr, wire)
        lost.add(exc.route.decode_id, exc.route.decode_addr)

    async def _first_start(self, req: GenerationRequest, lost: LostWorkers,
                           trace: RequestTrace) -> tuple[RouteReply, str, asyncio.Queue]:
        """One try to submit a new request (``wait_for_route`` repeats it): returns the
        route, the attempt's request id and its queue."""
        rid = req.request_id
        if not self.dispatching:  # no tokens could reach this attempt
            raise BackendUnavailable("the gateway's token stream has failed")
        wire = attempt_id(rid, lost.attempts)
        q = self.queues[wire] = asyncio.Queue()  # tokens may come before the Ack
        try:
            exclude = lost.exclude(await self.conductor.workers()) if lost.attempts else []
            return await self._start(req, [], exclude, wire, trace), wire, q
        except SubmitFailed as exc:
            self._pass_over(exc, lost, rid, wire)
            raise
        except BaseException:
            self.queues.pop(wire, None)
            raise

    async def _fail_over(self, req: GenerationRequest, generated: list[int], lost: LostWorkers,
                         trace: RequestTrace) -> tuple[RouteReply, str, asyncio.Queue]:
        """Submit ``req`` again, continuing after ``generated``, on a worker not lost;
        waits up to ``failover.wait_s`` for one. Returns the route, the attempt's
        request id and its queue; raises BackendUnavailable or ValueError."""
        rid = req.request_id
        deadline = time.monotonic() + self.failover.wait_s
        while True:
            if not self.dispatching:  # no tokens could reach this attempt
                raise BackendUnavailable("the gateway's token stream has failed")
            wire = attempt_id(rid, lost.attempts + 1)
            q = self.queues[wire] = asyncio.Queue()  # tokens may come before the Ack
            try:
                exclude = lost.exclude(await self.conductor.workers())
                route = await self._start(req, generated, exclude, wire, trace)
                lost.attempts += 1
                return route, wire, q
            except SubmitFailed as exc:  # it may have admitted it after all
                self._pass_over(exc, lost, rid, wire)
                why = str(exc)
            except (BackendUnavailable, BackendOverloaded) as exc:
                self.queues.pop(wire, None)
                why = str(exc)
            except BaseException:
                self.queues.pop(wire, None)
                raise
            if time.monotonic() + self.failover.poll_s > deadline:
                raise BackendUnavailable(
                    f"the decode worker was lost and no other took the request within "
                    f"{self.failover.wait_s:g}s: {why}")
            await asyncio.sleep(self.failover.poll_s)

    async def _next(self, q: asyncio.Queue, route: RouteReply):
        """The next event of the stream, or None once its decode worker is lost."""
        while True:
            try:
                # asyncio.timeout, not wait_for: on 3.11 wait_for swallows a cancel
                # that lands as the item arrives, and the consumer would never stop.
                async with asyncio.timeout(self.stall_check_s):
                    return await q.get()
            except TimeoutError:
                if not await self.conductor.decode_alive(route.decode_id, route.decode_addr):
                    return None

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Tokens]:
        rid = request.request_id
        # Front-ends make ids unique; a clash must not hijack one.
        if rid in self._running or rid in self.queues or rid in self.decoders:
            raise ValueError(f"request id {rid} is already running")
        if not self.dispatching:
            raise BackendUnavailable("the gateway's token stream has failed")
        self._running.add(rid)
        wire = rid  # the id the worker sees; a new one per failover attempt
        generated: list[int] = []
        pending: dict[int, Tokens] = {}
        lost = LostWorkers()
        failovers, finished = 0, False
        trace = RequestTrace(self.tracer, rid, request.trace, request.timing)
        try:
            route, wire, q = await wait_for_route(
                lambda: self._first_start(request, lost, trace), self.failover, rid)
            while True:
                tokens = await self._next(q, route)
                if isinstance(tokens, StreamMoved):  # with its KV: the same attempt goes on
                    route = moved_route(route, tokens, rid)
                    self.decoders[rid] = (route.decode_addr, wire)
                    continue
                # What the worker sent before it left is already queued ahead of this.
                leaving = tokens is not None and tokens is not _STREAM_LOST \
                    and tokens.finished and tokens.error == WORKER_LEAVING
                if tokens is None or leaving:
                    log.warning("decode worker lost, re-routing", request_id=rid,
                                worker_id=route.decode_id, tokens_so_far=len(generated),
                                reason="handed back" if leaving else "stopped heartbeating")
                    lost.add(route.decode_id, route.decode_addr)
                    failovers += 1
                    self.queues.pop(wire, None)  # what it still sends is dropped
                    self.decoders.pop(rid, None)
                    if not leaving:  # it let go itself; else it may be frozen, not dead
                        self._abort_soon(route.decode_addr, wire)
                    pending.clear()
                    try:
                        if failovers > self.failover.max_failovers:
                            raise BackendUnavailable(
                                f"{failovers} decode workers lost for this request")
                        route, wire, q = await self._fail_over(request, generated, lost,
                                                               trace)
                    except (BackendUnavailable, ValueError) as exc:
                        log.warning("request failed over to no worker", request_id=rid,
                                    error=str(exc))
                        yield Tokens(position=len(generated), token_ids=[], finished=True,
                                     finish_reason="error", error=str(exc))
                        return
                    continue
                if tokens is _STREAM_LOST:
                    yield Tokens(position=len(generated), token_ids=[], finished=True,
                                 finish_reason="error",
                                 error="the gateway's token stream has failed")
                    return
                pending[tokens.position] = tokens
                for event in release_in_order(pending, generated):
                    finished = finished or event.finished
                    yield trace.on_event(event)
                    if event.finished:
                        return
        finally:
            self._running.discard(rid)
            trace.end("abort")  # a no-op once the last event ended it
            self.queues.pop(wire, None)
            held = self.decoders.pop(rid, None)
            if held is not None and not finished:
                self._abort_soon(*held)

    def _abort_soon(self, addr: str, request_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self._send_abort(addr, request_id))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _send_abort(self, addr: str, request_id: str) -> None:
        try:
            await self._client(addr).call(Abort(reason="client"), request_id=request_id,
                                          timeout=self.rpc_timeout_s)
        except (RemoteError, RpcTimeout, ConnectionError) as exc:
            log.warning("abort not confirmed", request_id=request_id, error=str(exc))

    async def abort(self, request_id: str) -> None:
        # Popped: the generator's own close then has nothing left to abort.
        held = self.decoders.pop(request_id, None)
        if held is not None:
            await self._send_abort(*held)


_STREAM_LOST = object()  # queued to every request when the token dispatcher has died
