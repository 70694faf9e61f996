"""A stopping decode worker moving its running requests, KV and all, to other decode
workers (the sender's side of ``common/protocol_migrate.py``), so that nothing is
recomputed.

    ListWorkers ──► conductor: live decode workers of this model and KV layout, most
                    free blocks first
    engine: detach every decoding request at once (none advances further; the tokens
            it made before that are already on their way to the gateway)
    per request, concurrently:
        Migrate ──► target   ◄── MigrateReady (its blocks, token, advert)
        each layer of the blocks it lacks ══ data plane ══► target
        MigrateDone ──► target   ◄── Ack("adopted")
        StreamMoved ──► gateway (the stream follows the target); blocks freed here

A request that cannot move (no target, a refusal, a failed transfer, prompt still
prefilling) stays in ``streams``: the caller hands it back to its gateway, which
recomputes it elsewhere. A target that may have reserved blocks is sent an abort.
"""

from __future__ import annotations

import asyncio
import contextlib

import structlog

from common.protocol import (
    Abort,
    ListWorkers,
    Migrate,
    MigrateDone,
    MigrateReady,
    StreamMoved,
    WorkerList,
    WorkerStatus,
)
from common.transfer import MultiSender, TransferError
from common.zmq_rpc import RemoteError, RpcTimeout
from services.engine.outputs import Detached
from services.worker.context import RoleContext
from services.worker.decode_state import Remote, Stream

log = structlog.get_logger(__name__)

_FAILED = (TransferError, OSError, RemoteError, RpcTimeout, ConnectionError, TimeoutError,
           ValueError)


class Departures:
    """Moves this worker's running requests elsewhere on a planned stop."""

    def __init__(self, ctx: RoleContext, streams: dict[str, Stream],
                 remote: dict[str, Remote]) -> None:
        self.ctx = ctx
        self.streams = streams  # the role's: a moved request leaves it
        self.remote = remote  # waiting for a prefill's KV: not movable
        self.moved = 0
        self._sender: MultiSender | None = None

    async def close(self) -> None:
        if self._sender is not None:
            await self._sender.close()

    async def targets(self) -> list[WorkerStatus]:
        """Live decode workers KV can move to from here, most free blocks first."""
        ctx = self.ctx
        try:
            reply = await ctx.peer(ctx.settings.conductor_addr, "conductor").call(
                ListWorkers(model=ctx.settings.model), timeout=2.0)
        except (RpcTimeout, RemoteError, ConnectionError) as exc:
            log.warning("no worker list to move requests to", error=str(exc))
            return []
        if not isinstance(reply.record, WorkerList):
            return []
        facts = ctx.loop.facts
        fit = [w for w in reply.record.workers
               if w.alive and w.info.role in ("decode", "unified")
               and w.info.worker_id != ctx.worker_id and w.info.kv_addr
               and w.info.fingerprint == facts.fingerprint
               and w.info.block_size == facts.block_size]
        return sorted(fit, key=lambda w: -w.free_blocks)

    async def move_all(self) -> int:
        """Move what can be moved; returns how many requests now run elsewhere."""
        rids = [rid for rid in self.streams if rid not in self.remote]
        targets = await self.targets() if rids else []
        if not targets:
            return 0
        detached = await self.ctx.loop.run(lambda e: {rid: e.detach(rid) for rid in rids})
        # Everything the engine made before the detach has passed through on_output.
        jobs = [self._move(rid, stream, d, targets) for rid, d in detached.items()
                if d is not None and (stream := self.streams.get(rid)) is not None]
        moved = sum(await asyncio.gather(*jobs))
        self.moved += moved
        return moved

    async def _move(self, rid: str, stream: Stream, d: Detached,
                    targets: list[WorkerStatus]) -> bool:
        ctx = self.ctx
        offer = Migrate(prompt_token_ids=d.prompt_token_ids, output_token_ids=d.output_token_ids,
                        sampling=d.params, stream_addr=stream.addr,
                        start_position=stream.start_position, source_id=ctx.worker_id,
                        cache_salt=d.cache_salt, cached_tokens=d.num_cached_tokens)
        if stream.next_position != stream.start_position + len(d.output_token_ids):
            log.warning("stream and engine disagree: not moved", request_id=rid)
            return False
        for target in targets:
            addr = target.info.control_addr
            try:
                reply = await ctx.peer(addr).call(offer, request_id=rid,
                                                  timeout=ctx.settings.kv_lease_s)
            except (RemoteError, RpcTimeout, ConnectionError) as exc:
                log.info("migration refused", request_id=rid, target=target.info.worker_id,
                         error=str(exc))
                continue  # nothing reserved there (or it timed out: its lease frees it)
            try:
                if not isinstance(reply.record, MigrateReady):
                    raise ValueError(f"unexpected reply {type(reply.record).__name__}")
                chunks = await self._send_kv(rid, d, reply.record, target)
                if self.streams.get(rid) is not stream:
                    raise ValueError("aborted while moving")
                await ctx.peer(addr).call(MigrateDone(num_chunks=chunks), request_id=rid,
                                          timeout=ctx.settings.kv_lease_s)
            except _FAILED as exc:
                log.warning("migration failed, handing the request back", request_id=rid,
                            target=target.info.worker_id, error=str(exc) or type(exc).__name__)
                await self._abort_at(addr, rid)
                return False
            del self.streams[rid]
            ctx.streams.send(stream.addr, rid, StreamMoved(
                worker_id=target.info.worker_id, control_addr=addr,
                position=stream.next_position))
            if stream.span is not None:
                stream.span.set("finish_reason", "migrated")
                stream.span.end()
            await ctx.loop.run(lambda e: e.abort(rid))  # its blocks return to the free list
            ctx.metrics.kv_migrated_out.inc()
            log.info("request moved with its KV", request_id=rid, target=target.info.worker_id,
                     position=stream.next_position)
            return True
        return False

    async def _send_kv(self, rid: str, d: Detached, ready: MigrateReady,
                       target: WorkerStatus) -> int:
        """Each layer of the blocks the target lacks; returns the chunks sent."""
        if len(ready.block_ids) != len(d.block_ids) or not 0 <= ready.skip_blocks <= len(
                d.block_ids):
            raise ValueError(f"target reserved {len(ready.block_ids)} blocks, "
                             f"the request holds {len(d.block_ids)}")
        src, dest = d.block_ids[ready.skip_blocks:], ready.block_ids[ready.skip_blocks:]
        if not dest:
            return 0
        ctx = self.ctx
        if self._sender is None:
            s = ctx.settings
            self._sender = MultiSender(host_id=s.resolved_host_id, forced=(
                None if s.transfer_backend == "auto" else s.transfer_backend))
        addr = (self._sender.address_for(ready.kv_advert) if ready.kv_advert
                else target.info.kv_addr)
        layers = ctx.loop.facts.num_layers
        try:
            async with asyncio.timeout(ready.lease_s):
                for layer in range(layers):
                    payload = await ctx.loop.run(
                        lambda e, n=layer: e.kv_store.export_layer_bytes(n, src))
                    await self._sender.send(addr, rid, layer, dest, payload,
                                            token=ready.kv_token)
                    ctx.metrics.kv_transfer_bytes.inc(payload.nbytes)
                await self._sender.finish(addr, rid, layers, token=ready.kv_token)
        except BaseException:
            with contextlib.suppress(TransferError, OSError):
                await self._sender.abort(addr, rid, "migration failed", token=ready.kv_token)
            raise
        return layers

    async def _abort_at(self, addr: str, rid: str) -> None:
        with contextlib.suppress(Exception):  # it may be gone; its lease frees the blocks
            await self.ctx.peer(addr).call(Abort(reason="migration failed"), request_id=rid,
                                           timeout=2.0)
