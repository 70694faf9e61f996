"""The prefill role: compute a prompt, send its first token to the gateway and its KV to
the decode worker that asked.

    decode ──Prefill(block ids)──► prefill worker
                                   │ run the prompt (chunked); in the step that completes
                                   │ it, each layer's KV is copied out as soon as that
                                   │ layer is computed (on a GPU, on a side stream the
                                   │ compute never waits for) and sent while the next
                                   │ computes
                                   ├──KV, one payload per layer──► decode's data plane
                                   ├──Tokens(position 0)──► gateway
                                   └──PrefillDone(first token)──► decode (the reply)

The request's blocks are held until every layer is sent, then released; they stay in
the local prefix cache for the next prompt that shares them.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import time
from typing import TYPE_CHECKING

import structlog

from common.protocol import Error, Prefill, PrefillDone, Timing, Tokens, WorkerStats
from common.sampling_params import SamplingParams
from common.tracing import Span, wall_ns
from common.transfer import MultiSender, TransferError
from common.transfer.negotiate import scheme_of
from common.transfer.wire import MAX_TOKEN_BYTES, WHOLE
from services.engine.outputs import RequestOutput
from services.engine.tp_direct import (
    DIRECT_BACKENDS,
    Route,
    chunks_per_receiver,
    plan_targets,
    split_heads,
)
from services.worker.context import RoleContext
from services.worker.engine_loop import exported_bytes
from services.worker.pool_link import PoolLink
from services.worker.token_streams import logprob_records

if TYPE_CHECKING:
    from services.engine.sequence import Sequence

log = structlog.get_logger(__name__)


# A lease longer than this would hold a decode worker's blocks for over an hour.
MAX_LEASE_S = 3600.0
_U64 = (1 << 64) - 1


def prefill_problem(rec: Prefill) -> str | None:
    """Why ``rec`` cannot be served as sent (its lease, the decode worker's address, the
    transfer's token, its block ids), or None: checked before it takes anything here,
    so that a request that lies gets "bad_request", not an error halfway through."""
    if not 0 < rec.lease_s <= MAX_LEASE_S:  # NaN fails this too
        return f"lease_s must be in (0, {MAX_LEASE_S:g}], got {rec.lease_s!r}"
    if rec.kv_advert is None:
        try:
            scheme_of(rec.kv_addr)
        except ValueError as exc:
            return f"kv_addr: {exc}"
    if len(rec.kv_token) > MAX_TOKEN_BYTES:
        return f"kv_token must be at most {MAX_TOKEN_BYTES} bytes, got {len(rec.kv_token)}"
    if not all(0 <= b <= _U64 for b in rec.block_ids):
        return "block_ids must be integers in [0, 2^64)"
    if not 0 <= rec.skip_blocks <= len(rec.block_ids):
        return (f"skip_blocks must be in [0, {len(rec.block_ids)}] (the block ids sent), "
                f"got {rec.skip_blocks}")
    return None


def prefill_params(params: SamplingParams) -> SamplingParams:
    """The request's sampling, cut to the one token prefill produces."""
    return dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))


@dataclasses.dataclass(eq=False)
class Job:
    """One prefill in flight: where its KV goes, and the layers waiting to be sent."""

    rec: Prefill
    addr: str  # the decode worker's data-plane address for the chosen backend
    done: asyncio.Future  # the finished RequestOutput
    layers: asyncio.Queue = dataclasses.field(default_factory=asyncio.Queue)
    error: str | None = None
    sent_from: float | None = None  # monotonic time the first layer left
    sent_bytes: int = 0
    # The direct path (services/engine/tp_direct.py): rank 0's head slice (None where it
    # holds every head), which rank sends which heads where, and each receiver's chunk
    # count; no targets when rank 0 sends all heads to one receiver.
    heads: tuple[int, int, int] | None = None
    targets: tuple = ()
    finish: dict = dataclasses.field(default_factory=dict)
    total_heads: int = 0


class PrefillRole:
    """Runs prompts for decode workers; owns the data-plane sender their KV leaves by."""

    def __init__(self, ctx: RoleContext, pool: PoolLink) -> None:
        self.ctx = ctx
        self.pool = pool
        self.jobs: dict[str, Job] = {}
        self.sent_bytes = 0
        self.backends: collections.Counter[str] = collections.Counter()
        self.paths: collections.Counter[str] = collections.Counter()  # of a TP engine
        self.done = 0
        self._slicing: tuple | None = None  # (each rank's heads, tensor-parallel?)
        self._freeing: dict[str, asyncio.Task] = {}  # finished jobs' blocks being freed
        self._aio = asyncio.get_running_loop()
        s = ctx.settings
        forced = None if s.transfer_backend == "auto" else s.transfer_backend
        self.sender = MultiSender(host_id=s.resolved_host_id, forced=forced)

    async def start(self) -> None:
        pass  # the sender connects per peer, on first use

    async def close(self) -> None:
        if self._freeing:  # the engine loop runs until after this: let them finish
            await asyncio.wait(set(self._freeing.values()), timeout=5)
        await self.sender.close()

    @property
    def kv_addr(self) -> str:
        return ""  # KV leaves a prefill worker; none arrives

    def report(self, stats: WorkerStats) -> WorkerStats:
        """``stats`` with this role's counters filled in."""
        return dataclasses.replace(
            stats, kv_bytes_sent=self.sent_bytes, prefills_done=self.done,
            prefill_jobs=len(self.jobs), kv_chunks_resent=self.sender.resent,
            transfer_backends=dict(self.backends), kv_send_paths=dict(self.paths))

    def on_output(self, out) -> bool:
        """Claim a finished prefill's output; False if it is not ours."""
        job = self.jobs.get(out.request_id)
        if job is None:
            return False
        if out.finished and not job.done.done():
            job.done.set_result(out)
        return True

    def on_layer(self, layer: int, seqs: list[Sequence]) -> None:
        """Engine thread: copy out layer ``layer`` of every prompt completing this step."""
        loop = self.ctx.loop
        block_size = loop.facts.block_size
        for seq in seqs:
            job = self.jobs.get(seq.request_id)
            if job is None:
                continue
            rec = job.rec
            blocks = seq.block_table[:-(-seq.num_prompt_tokens // block_size)]
            if len(blocks) != len(rec.block_ids):
                job.error = (f"decode reserved {len(rec.block_ids)} blocks, "
                             f"prompt fills {len(blocks)}")
                self._aio.call_soon_threadsafe(job.layers.put_nowait, (layer, None))
                continue
            pending = (loop.export_layer_async if job.heads is None
                       else loop.export_local_slice)(layer, blocks[rec.skip_blocks:])
            self._aio.call_soon_threadsafe(job.layers.put_nowait, (layer, pending))

    async def drain(self, timeout_s: float) -> int:
        """A planned stop: let the prefills in flight finish (their decode workers wait
        for the KV), for up to ``timeout_s``; returns how many were still running then."""
        deadline = self._aio.time() + timeout_s
        while self.jobs and self._aio.time() < deadline:
            await asyncio.sleep(0.05)
        return len(self.jobs)

    async def handle(self, rid: str, rec: Prefill, trace: str | None = None):
        ctx = self.ctx
        arrived = time.monotonic()
        span = ctx.tracer.span("prefill.request", trace, {
            "request_id": rid, "worker_id": ctx.worker_id,
            "prompt_tokens": len(rec.prompt_token_ids)})
        try:
            return await self._handle(rid, rec, arrived, span)
        finally:
            span.end()

    async def _handle(self, rid: str, rec: Prefill, arrived: float, span: Span):
        ctx = self.ctx
        freeing = self._freeing.get(rid)
        if freeing is not None:  # the same id's last job still holds its blocks
            await asyncio.wait({freeing})
        if rid in self.jobs:  # a re-routed request while its first prefill still runs
            return Error("bad_request", f"request id {rid!r} is already being prefilled here")
        problem = prefill_problem(rec)
        if problem is not None:
            return Error("bad_request", problem)
        try:
            params = prefill_params(rec.sampling)
        except ValueError as exc:
            return Error("bad_request", str(exc))
        try:
            addr = (self.sender.address_for(rec.kv_advert) if rec.kv_advert
                    else rec.kv_addr)
        except (TransferError, ValueError) as exc:
            return Error("bad_request", f"no usable data plane to the decode worker: {exc}")
        backend = addr.partition("://")[0]
        self.backends[backend] += 1
        ctx.metrics.transfer_backend.labels(backend=backend).inc()
        job = self.jobs[rid] = Job(rec, addr, self._aio.create_future())
        await self._choose_path(rid, job, backend)
        deadline = self._aio.time() + rec.lease_s  # the decode worker gives up then
        sending = asyncio.create_task(self._send_layers(rid, job))
        try:
            try:
                await self.pool.with_prefix(
                    rec.prompt_token_ids, rec.cache_salt, _start, rid, rec, params, job)
            except ValueError as exc:
                return Error("bad_request", str(exc))
            out = await job.done
            computed = time.monotonic()
            if out.finish_reason in ("abort", "error") or not out.new_token_ids:
                raise TransferError(f"prefill ended with {out.finish_reason}")
            first = out.new_token_ids[0]
            self.pool.computed(rec.prompt_token_ids, rec.cache_salt)
            ctx.streams.send(rec.stream_addr, rid, Tokens(
                position=0, token_ids=[first], prompt_tokens=out.num_prompt_tokens,
                cached_tokens=out.num_cached_tokens, source="prefill",
                logprobs=logprob_records(out.new_logprobs)))
            try:  # finish waits for the decode worker's verdicts: not past its lease
                async with asyncio.timeout_at(deadline):  # cancel-safe, unlike wait_for
                    chunks = await sending
            except TimeoutError:
                raise TransferError(f"KV not accepted within the {rec.lease_s} s lease") from None
            self.done += 1
            return PrefillDone(first_token=first, num_chunks=chunks,
                               cached_tokens=out.num_cached_tokens,
                               timing=self._timing(job, span, backend, arrived, computed,
                                                   out.queue_time_s or 0.0))
        except (TransferError, OSError) as exc:
            log.warning("prefill failed", request_id=rid, error=str(exc))
            for addr in job.finish or (job.addr,):
                with contextlib.suppress(TransferError, OSError):
                    await self.sender.abort(addr, rid, str(exc), token=rec.kv_token)
            return Error("prefill_failed", str(exc))
        finally:
            sending.cancel()
            self.jobs.pop(rid, None)
            self._free(rid)

    def _free(self, rid: str) -> None:
        """Free ``rid``'s blocks on the engine thread without waiting for it: the command
        runs only between steps, and the reply (the decode worker's word that the KV is
        complete) waiting for it waited for the next queued prompt's whole prefill."""
        task = self._freeing[rid] = asyncio.ensure_future(self.ctx.loop.run(_drop, rid))

        def freed(t: asyncio.Task) -> None:
            if self._freeing.get(rid) is t:
                del self._freeing[rid]
            if not t.cancelled() and t.exception() is not None:
                log.error("freeing a prefill's blocks failed", request_id=rid,
                          error=repr(t.exception()))
        task.add_done_callback(freed)

    async def _choose_path(self, rid: str, job: Job, backend: str) -> None:
        """On any backend, to a decode worker that takes slices, each rank sends its heads'
        slices straight to the receivers that hold them (one, or one per decode rank
        where the advert lists ranks); else a tensor-parallel engine's rank 0 gathers
        them and sends all heads (``services/engine/tp_direct.py``)."""
        if self._slicing is None:
            self._slicing = await self.ctx.loop.run(_slicing)
        if not self._slicing:
            return
        senders, tp = self._slicing
        advert = job.rec.kv_advert
        receivers = None
        if advert is not None and advert.slices and backend in DIRECT_BACKENDS:
            addrs = [r.endpoints.get(backend) for r in advert.ranks]
            if advert.ranks and all(addrs):
                receivers = [(a, r.head_start, r.head_count)
                             for a, r in zip(addrs, advert.ranks, strict=True)]
            elif tp and not advert.ranks:
                receivers = [(job.addr, 0, senders[0][2])]
        if receivers is None:
            if tp:
                self.paths["gathered"] += 1
                log.info("tp_kv_path", request_id=rid, path="gathered")
            return  # one rank: all heads to one receiver
        job.targets = tuple(plan_targets(senders, receivers))
        job.finish = chunks_per_receiver(job.targets, self.ctx.loop.facts.num_layers)
        job.heads = tuple(senders[0]) if tp else None
        job.total_heads = senders[0][2]
        self.paths["direct"] += 1
        log.info("tp_kv_path", request_id=rid, path="direct", receivers=len(receivers))

    def _timing(self, job: Job, span: Span, backend: str, arrived: float, computed: float,
                queued: float) -> Timing:
        """The stages this worker saw (queue, prefill, the KV sent after the prompt was
        computed), also recorded as spans under ``span``."""
        sent = time.monotonic()
        tracer, parent = self.ctx.tracer, span.traceparent
        tracer.record("prefill.queue", parent, wall_ns(arrived), wall_ns(arrived + queued))
        tracer.record("prefill.compute", parent, wall_ns(arrived + queued), wall_ns(computed),
                      {"cached_tokens": job.rec.skip_blocks})
        tracer.record("prefill.kv_transfer", parent, wall_ns(job.sent_from or computed),
                      wall_ns(sent), {"bytes": job.sent_bytes, "backend": backend,
                                      "layers": self.ctx.loop.facts.num_layers})
        return Timing(queue_ms=queued * 1e3, prefill_ms=(computed - arrived - queued) * 1e3,
                      kv_transfer_ms=(sent - computed) * 1e3, kv_bytes=job.sent_bytes,
                      kv_backend=backend)

    async def _send_layers(self, rid: str, job: Job) -> int:
        """Send each layer as the engine hands it over; then close the transfer."""
        ctx = self.ctx
        num_layers, block_size = ctx.loop.facts.num_layers, ctx.loop.facts.block_size
        dest = list(job.rec.block_ids[job.rec.skip_blocks:])
        start = None
        for _ in range(num_layers):
            layer, pending = await job.layers.get()
            if pending is None or job.error:
                raise TransferError(job.error or "KV export failed")
            payload = await exported_bytes(pending)
            start = start or time.perf_counter()
            job.sent_from = job.sent_from or time.monotonic()
            nbytes = payload.nbytes
            if not job.targets:
                await self.sender.send(job.addr, rid, layer, dest, payload,
                                       token=job.rec.kv_token, heads=WHOLE)
            else:
                held = job.heads[1] if job.heads else job.total_heads
                for rank, addr, first, count, heads in job.targets:
                    if rank == 0:
                        await self.sender.send(
                            addr, rid, layer, dest, split_heads(payload, held, first, count,
                                                                2 * len(dest) * block_size),
                            token=job.rec.kv_token, heads=heads)
                # Every head has the same bytes: the worker's KV that left (other ranks'
                # slices too), all heads once.
                nbytes = payload.nbytes // held * job.total_heads
            self.sent_bytes += nbytes
            job.sent_bytes += nbytes
            ctx.metrics.kv_transfer_bytes.inc(nbytes)
            ctx.metrics.kv_sent_bytes.labels(backend=job.addr.partition("://")[0]).inc(nbytes)
        # Each receiver counts every sending rank's slices of every layer it takes. All
        # at once: a receiver sends its verdicts when its FINISH comes, and one sender
        # waits for every verdict of the request, whichever receiver gives it.
        await asyncio.gather(*(self.sender.finish(addr, rid, count, token=job.rec.kv_token)
                               for addr, count in (job.finish or {job.addr: num_layers})
                               .items()))
        chunks = sum(job.finish.values()) if job.finish else num_layers
        ctx.metrics.kv_transfer_seconds.inc(time.perf_counter() - (start or time.perf_counter()))
        return chunks

    async def abort(self, rid: str) -> None:
        job = self.jobs.get(rid)
        if job is not None and not job.done.done():
            await self.ctx.loop.run(lambda e: e.abort(rid))
            if not job.done.done():
                job.done.set_result(RequestOutput(rid, [], 0, finished=True,
                                                  finish_reason="abort"))


def _start(engine, rid: str, rec: Prefill, params: SamplingParams, job: Job):
    """Engine thread: the prompt's route first, when every rank sends its own slice."""
    if job.heads is not None:
        engine.kv_store.route(rid, Route(job.addr, rec.kv_token, rec.skip_blocks,
                                         tuple(rec.block_ids[rec.skip_blocks:]),
                                         job.targets))
    return engine.add_request(rid, rec.prompt_token_ids, params, cache_salt=rec.cache_salt,
                              hold_blocks=True)


def _slicing(engine) -> tuple:
    """Engine thread: (each rank's head slice, tensor-parallel?); () for an engine
    without KV heads (the simulated one)."""
    store = engine.kv_store
    if hasattr(store, "route"):
        return [None if h is None else tuple(h) for h in store.heads_by_rank], True
    heads = getattr(getattr(engine, "model_config", None), "num_kv_heads", 0)
    return ([(0, heads, heads)], False) if heads else ()


def _drop(engine, rid: str) -> None:
    """Engine thread: end ``rid`` if it still runs, and free the blocks it held."""
    engine.abort(rid)
    engine.release(rid)
    unroute = getattr(engine.kv_store, "unroute", None)
    if unroute is not None:
        unroute(rid)
