"""The decode role (and unified, which is decode that always prefills itself).

Lifecycle of a request on a decode worker::

    Generate ──► local prefill? ── yes ──► engine queue ──► tokens 0, 1, 2, … ──► gateway
                     │ no
                     ▼
        reserve blocks (reusing this worker's cached prefix), expect KV under a lease,
        ask the prefill worker (Prefill: our data-plane address + block ids we lack)
                     │
        KV payloads land straight in the reserved blocks; PrefillDone brings token 0
        (which prefill already streamed to the gateway)
                     │
        complete ──► engine running batch ──► tokens 1, 2, … ──► gateway

If the KV is not all there within the lease, or the prefill worker fails or dies, the
reserved blocks are released and the prompt is prefilled here; the request completes.

Overload: with ``max_waiting`` requests already waiting for a step (the engine's queue
as of its last snapshot, plus Generates being admitted), a Generate is answered at once
with ``Error("overloaded", retry_after_s)``, before it touches the engine: the queue
stays bounded, and the gateway answers 429 rather than a timeout after a long wait.

A planned stop (``hand_back``) refuses new requests and moves each decoding request,
KV and all, to another decode worker (``migrate_out.py``; the receiving side is
``migrate_in.py``); a stream that cannot move ends with ``WORKER_LEAVING``: its gateway
continues it on another worker, which recomputes the KV.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import secrets
import time

import structlog

from common.protocol import (
    WORKER_LEAVING,
    Abort,
    Ack,
    Error,
    Generate,
    KVAdvert,
    Prefill,
    RankAdvert,
    Timing,
    Tokens,
    TtftSample,
    WorkerStats,
)
from common.transfer import MultiReceiver, TransferError
from common.zmq_rpc import RemoteError, RpcTimeout
from kernels import cpu_copysum
from services.engine.sequence import SequenceStatus
from services.worker.context import RoleContext
from services.worker.decode_ranks import drop_ranks, expect_ranks, landed, listen_ranks
from services.worker.decode_sink import DecodeSink
from services.worker.decode_state import Remote, Stream
from services.worker.migrate_in import Arrivals
from services.worker.migrate_out import Departures
from services.worker.pool_link import PoolLink
from services.worker.stage_timing import stage_timing
from services.worker.token_streams import logprob_records
from services.worker.tombstones import Tombstones

log = structlog.get_logger(__name__)


class DecodeRole:
    """Generates for the gateway; owns the data-plane receiver KV from prefill lands on."""

    def __init__(self, ctx: RoleContext, pool: PoolLink) -> None:
        self.ctx = ctx
        self.pool = pool
        self.streams: dict[str, Stream] = {}
        self.remote: dict[str, Remote] = {}
        self.local_fallbacks = 0
        self.admitting = 0  # Generates between arrival and the engine's queue
        self.leaving = False
        self.aborted = Tombstones()  # aborts that may have overtaken their Generate
        # First-token times for the conductor's TTFT correction, sent with the next
        # heartbeat; bounded, so a conductor that stops listening costs nothing.
        self.ttft_samples: collections.deque[TtftSample] = collections.deque(maxlen=64)
        s = ctx.settings
        kinds = None if s.transfer_backend == "auto" else (s.transfer_backend,)
        # Each TP rank's (endpoints, heads): tp_recv.py; empty: rank 0 takes every head.
        self._ranks: list[tuple[dict, int, int]] = []
        self.sink = DecodeSink(self.remote, ctx.loop, ctx.metrics, lambda: bool(self._ranks))
        self.receiver = MultiReceiver(kinds, host=s.kv_host, port=s.kv_port,
                                      sink=self.sink, slice_sink=self.sink.on_slice,
                                      host_id=s.resolved_host_id)
        ctx.metrics.kv_refused.read = lambda: self.receiver.refused
        self.arrivals = Arrivals(self)  # requests moved here by stopping workers
        self.departures = Departures(ctx, self.streams, self.remote)  # and from here

    async def start(self) -> None:
        await self.receiver.start()
        s = self.ctx.settings
        kinds = list(self.receiver.advert().endpoints)  # the followers serve what rank 0 does
        if "shm" in kinds and self.ctx.loop.lands and s.tensor_parallel_size == 1:
            cpu_copysum.kernel()  # its build starts now, in a thread, not at the first KV
        if s.tensor_parallel_size > 1 and kinds:  # every rank receives its own heads
            self._ranks = await self.ctx.loop.run(
                listen_ranks, kinds, s.kv_host, s.resolved_host_id)

    async def close(self) -> None:
        await self.arrivals.close()
        await self.departures.close()
        await self.receiver.close()

    @property
    def kv_addr(self) -> str:
        return self.ctx.advertised(self.receiver.address)

    def kv_advert(self) -> KVAdvert:
        """The receiver's advert, each network endpoint as peers reach it."""
        advert = self.receiver.advert()
        endpoints = {k: self.ctx.advertised(a) for k, a in advert.endpoints.items()}
        ranks = [RankAdvert({k: self.ctx.advertised(a) for k, a in (e or endpoints).items()},
                            start, count) for e, start, count in self._ranks]
        return KVAdvert(host_id=advert.host_id, endpoints=endpoints,
                        slices=self.ctx.settings.tensor_parallel_size == 1 or bool(ranks),
                        ranks=ranks)

    @property
    def received_bytes(self) -> int:
        """Verified KV bytes taken into reserved blocks (counted by the sink)."""
        return self.sink.received_bytes

    @received_bytes.setter
    def received_bytes(self, value: int) -> None:
        self.sink.received_bytes = value

    def report(self, stats: WorkerStats) -> WorkerStats:
        """``stats`` with this role's counters filled in."""
        return dataclasses.replace(
            stats, live_transfers=self.receiver.live(), local_fallbacks=self.local_fallbacks,
            kv_bytes_received=self.received_bytes, kv_chunks_retried=self.receiver.retried,
            kv_messages_refused=self.receiver.refused, kv_advert=self.kv_advert(),
            kv_migrated_in=self.arrivals.adopted, kv_migrated_out=self.departures.moved)

    def take_ttft_samples(self) -> list[TtftSample]:
        """The first-token times since the last call, oldest first (pops one at a time:
        nothing appended meanwhile is lost)."""
        samples, taken = self.ttft_samples, []
        while samples:
            taken.append(samples.popleft())
        return taken

    def _first_token(self, stream: Stream, at: float) -> None:
        # Only a request's first submission: a resumed one was admitted without an SLO.
        if stream.start_position == 0:
            self.ttft_samples.append(TtftSample(
                request_id=stream.request_id, seconds=max(0.0, at - stream.arrived),
                remote=stream.asked is not None))

    def overloaded(self) -> Error | None:
        """The refusal for one more request when the queue is full, else None."""
        loop = self.ctx.loop
        if loop.load.waiting + self.admitting < self.ctx.settings.max_waiting:
            return None
        rate = loop.prefill_tokens_per_s
        drain = loop.load.queued_prefill_tokens / rate if rate else 1.0
        return Error("overloaded", f"{self.ctx.worker_id}: {loop.load.waiting} requests "
                     "waiting", retry_after_s=max(1.0, drain))

    async def handle(self, rid: str, rec: Generate, trace: str | None = None):
        if self.leaving:
            return Error("unavailable", f"{self.ctx.worker_id} is shutting down")
        if rid in self.streams:
            return Error("bad_request", f"request id {rid!r} is already in use")
        if rid in self.aborted:
            return Error("aborted", f"request {rid!r} was aborted")
        refusal = self.overloaded()
        if refusal is not None:
            return refusal
        self.admitting += 1
        try:
            return await self._admit(rid, rec, trace)
        finally:
            self.admitting -= 1

    async def _admit(self, rid: str, rec: Generate, trace: str | None):
        ctx = self.ctx
        params = rec.sampling  # checked by SamplingParams itself when it was decoded
        prompt, salt = rec.prompt_token_ids, rec.cache_salt
        # A resumed stream's prompt ends with the tokens it already streamed (positions
        # 0 onwards): the engine keeps them as output, so its output counts from 0.
        resumed = rec.start_position
        if not 0 <= resumed < len(prompt):
            return Error("bad_request", f"start_position {resumed} must be below the "
                                        f"prompt's {len(prompt)} tokens")
        stream = self.streams[rid] = Stream(
            rid, rec.stream_addr, 0, prompt[:len(prompt) - resumed], salt, resumed,
            span=ctx.tracer.span("decode.request", trace, {
                "request_id": rid, "worker_id": ctx.worker_id,
                "prompt_tokens": len(prompt)}), arrived=time.monotonic())
        try:
            # A resumed stream (start_position > 0) prefills here: the prefill worker
            # only ever streams position 0.
            if rec.prefill_addr and ctx.settings.role == "decode" and rec.start_position == 0:
                slots = await self.pool.with_prefix(
                    prompt, salt, lambda e: e.reserve_remote_prefill(
                        rid, prompt, params, cache_salt=salt))
                if slots is not None and await self._undo_if_aborted(rid, stream):
                    return Error("aborted", f"request {rid!r} was aborted")
                if slots is not None:
                    # A secret per transfer: reaching the KV port and guessing the
                    # request id must not be enough to write into these blocks.
                    token = secrets.token_bytes(16)
                    if self._ranks and not await expect_ranks(self, rid, stream, token, slots):
                        return Error("aborted", f"request {rid!r} was aborted")
                    transfer = self.receiver.expect(rid, ctx.settings.kv_lease_s,
                                                    token=token)
                    self.remote[rid] = Remote(slots, transfer, rec.prefill_addr,
                                              time.monotonic())
                    asyncio.create_task(self._remote_prefill(rid, rec))
                    return Ack(detail="remote")
            await self.pool.with_prefix(
                prompt, salt, lambda e: e.add_request(rid, prompt, params, cache_salt=salt,
                                                      resumed=resumed))
            if await self._undo_if_aborted(rid, stream):
                return Error("aborted", f"request {rid!r} was aborted")
            return Ack(detail="local")
        except ValueError as exc:
            self.streams.pop(rid, None)
            stream.span.end()
            return Error("bad_request", str(exc))

    async def _undo_if_aborted(self, rid: str, stream: Stream) -> bool:
        """True (and the engine's copy dropped) if an Abort ran while ``rid`` was
        being admitted: the engine did not know it then, so nothing else frees it. A
        short request the engine finished before this ran (a busy host) was not."""
        if self.streams.get(rid) is stream or stream.finished:
            return False
        await self.ctx.loop.run(lambda e: e.abort(rid))
        return True

    async def _remote_prefill(self, rid: str, rec: Generate) -> None:
        ctx = self.ctx
        remote = self.remote[rid]
        lease = ctx.settings.kv_lease_s
        stream = self.streams.get(rid)
        if stream is not None:
            stream.asked = time.monotonic()
        asking = asyncio.create_task(ctx.peer(rec.prefill_addr).call(Prefill(
            prompt_token_ids=rec.prompt_token_ids, sampling=rec.sampling,
            stream_addr=rec.stream_addr, kv_addr=self.kv_addr,
            block_ids=remote.slots.block_ids, skip_blocks=remote.slots.num_cached_blocks,
            lease_s=lease, decode_id=ctx.worker_id, cache_salt=rec.cache_salt,
            kv_advert=self.kv_advert(), kv_token=remote.transfer.token or b""),
            request_id=rid, timeout=lease,
            trace=stream.span.traceparent if stream is not None else None))
        arriving = asyncio.create_task(remote.transfer.wait())
        try:
            # Whichever fails first decides: a prefill worker that dies mid-transfer
            # breaks the data plane long before its reply would time out.
            done, _ = await asyncio.wait({asking, arriving}, timeout=lease,
                                         return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()  # raises the first failure
            if len(done) < 2:
                raise TimeoutError(f"KV not complete within its {lease} s lease")
            done_rec = asking.result().record
            first = done_rec.first_token
            if self._ranks and rid in self.remote:  # the other ranks' heads in too
                missing, nbytes = await landed(ctx.loop, rid, remote.transfer.token, lease)
                if missing:
                    raise TransferError(missing)
                self.sink.count(nbytes)
            if rid not in self.remote:  # aborted meanwhile
                return
            if stream is not None:
                stream.kv_done, stream.measured = time.monotonic(), done_rec.timing
                self._first_token(stream, stream.kv_done)
            out = await ctx.loop.run(lambda e: e.complete_remote_prefill(rid, first))
            ctx.metrics.kv_transfer_seconds.inc(time.monotonic() - remote.started)
            if out.finished:
                self._emit_finish(rid, 1, out.finish_reason, out.num_cached_tokens)
        except (RemoteError, RpcTimeout, TransferError, TimeoutError, OSError) as exc:
            if rid in self.remote:
                await self._fall_back(rid, remote, str(exc) or type(exc).__name__)
        finally:
            for task in (asking, arriving):
                task.cancel()
            self.remote.pop(rid, None)

    async def _fall_back(self, rid: str, remote: Remote, reason: str) -> None:
        log.warning("remote prefill failed, prefilling locally", request_id=rid, reason=reason)
        self.receiver.cancel(rid)
        asyncio.create_task(self._tell_prefill_abort(remote.prefill_addr, rid))
        token = remote.transfer.token if self._ranks else None
        if await self.ctx.loop.run(cancel_if_waiting, rid, token):
            self.local_fallbacks += 1
            self.ctx.metrics.local_fallbacks.inc()

    async def _tell_prefill_abort(self, addr: str, rid: str) -> None:
        # The prefill worker may be gone; then there is nothing left to free there.
        with contextlib.suppress(Exception):
            await self.ctx.peer(addr).send(Abort(reason="decode gave up"), request_id=rid)

    def on_output(self, out) -> None:
        stream = self.streams.get(out.request_id)
        if stream is None:
            return
        position = stream.start_position + out.num_output_tokens - len(out.new_token_ids)
        if out.num_output_tokens == len(out.new_token_ids) and out.new_token_ids:
            stream.first, stream.queued = time.monotonic(), out.queue_time_s or 0.0
            self._first_token(stream, stream.first)  # prefilled here, or fell back here
            # The first token of a prompt computed here (a remote prefill's first token
            # never passes through): its blocks may serve other workers.
            self.pool.computed(stream.prompt_token_ids, stream.cache_salt)
        self.ctx.streams.send(stream.addr, out.request_id, Tokens(
            position=position, token_ids=list(out.new_token_ids), finished=out.finished,
            finish_reason=out.finish_reason, prompt_tokens=out.num_prompt_tokens,
            cached_tokens=out.num_cached_tokens, source="decode",
            error="engine step failed" if out.finish_reason == "error" else None,
            logprobs=logprob_records(out.new_logprobs),
            timing=self._finished(stream, out.finish_reason) if out.finished else None))
        stream.next_position = position + len(out.new_token_ids)
        if out.finished:
            stream.finished = True
            self.streams.pop(out.request_id, None)

    def _emit_finish(self, rid: str, count: int, reason: str | None, cached: int) -> None:
        stream = self.streams.pop(rid, None)
        if stream is not None:
            stream.finished = True
            self.ctx.streams.send(stream.addr, rid, Tokens(
                position=stream.start_position + count, token_ids=[], finished=True,
                finish_reason=reason, prompt_tokens=stream.prompt_tokens,
                cached_tokens=cached, source="decode", timing=self._finished(stream, reason)))

    def _finished(self, stream: Stream, reason: str | None) -> Timing:
        """The stages of ``stream``, now finished; its spans recorded and ended."""
        timing = stage_timing(stream, self.ctx.tracer, time.monotonic())
        stream.span.set("finish_reason", reason or "")
        stream.span.end()
        return timing

    async def hand_back(self, migrate: bool = True) -> tuple[int, int]:
        """A planned stop: refuse new requests; move what runs to other decode workers
        with its KV (``migrate``, see ``migrate_out.py``); end every other stream with
        ``WORKER_LEAVING`` (its gateway continues it elsewhere, recomputing) and free
        what it held. Returns (requests moved, requests handed back)."""
        self.leaving = True
        moved = await self.departures.move_all() if migrate else 0
        handed = list(self.streams.items())
        self.streams.clear()  # what the engine still produces for them is not sent
        for rid, stream in handed:
            stream.span.end()
            self.ctx.streams.send(stream.addr, rid, Tokens(
                position=stream.next_position, token_ids=[], finished=True,
                finish_reason="error", prompt_tokens=stream.prompt_tokens,
                source="decode", error=WORKER_LEAVING))
        for rid, _ in handed:
            await self.abort(rid)
        return moved, len(handed)

    async def abort(self, rid: str) -> None:
        stream = self.streams.pop(rid, None)
        if stream is not None:
            stream.span.set("finish_reason", "abort"), stream.span.end()
        elif rid not in self.remote:
            self.aborted.add(rid)  # it may not have arrived yet
        remote = self.remote.pop(rid, None)
        if remote is not None:
            self.receiver.cancel(rid)
            if remote.prefill_addr:  # none for KV a stopping decode worker moves here
                asyncio.create_task(self._tell_prefill_abort(remote.prefill_addr, rid))
        tok = remote.transfer.token if remote is not None and self._ranks else None
        await self.ctx.loop.run(lambda e: (drop_ranks(e, rid, tok), e.abort(rid)))


def cancel_if_waiting(engine, rid: str, token: bytes | None = None) -> bool:
    """Engine thread: stop waiting for ``rid``'s KV and prefill it here instead; False
    if it is no longer waiting (aborted, or completed meanwhile)."""
    drop_ranks(engine, rid, token)
    seq = engine.requests.get(rid)
    if seq is None or seq.status is not SequenceStatus.WAITING_FOR_KV:
        return False
    engine.cancel_remote_prefill(rid)
    return True
