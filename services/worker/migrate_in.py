"""A decode worker taking over a running request, KV and all, from one that is stopping
(the target's side of ``common/protocol_migrate.py``).

    Migrate ──► reserve blocks for every token but the last (reusing cached prefix
                blocks), expect the rest over the data plane under a fresh token
            ◄── MigrateReady(block ids, skip, token, advert)
    KV ══════► written straight into the reserved blocks (the remote-prefill sink)
    MigrateDone ──► the transfer is DONE: the request joins the running batch, its
                    next token is computed from the moved KV; tokens go to the
                    gateway under the same request id, from the next position
            ◄── Ack("adopted")

Nothing is adopted without a MigrateDone within the lease: the blocks are freed and the
stopping worker hands the request back to its gateway instead.
"""

from __future__ import annotations

import asyncio
import secrets
import time

import structlog

from common.protocol import Ack, Error, Migrate, MigrateDone, MigrateReady
from common.transfer import Transfer, TransferError
from services.worker.decode_state import DecodeParts, Remote, Stream

log = structlog.get_logger(__name__)


class Arrivals:
    """Requests offered by stopping workers, from Migrate until adopted or dropped."""

    def __init__(self, role: DecodeParts) -> None:
        self.role = role
        self.pending: dict[str, Transfer | None] = {}  # None: every block was cached here
        self.adopted = 0
        self._expiry: set[asyncio.Task] = set()

    async def offer(self, rid: str, rec: Migrate, trace: str | None = None):
        role, ctx = self.role, self.role.ctx
        if role.leaving:
            return Error("unavailable", f"{ctx.worker_id} is shutting down")
        if rid in role.streams or rid in role.remote or rid in self.pending:
            return Error("bad_request", f"request id {rid!r} is already in use")
        if rid in role.aborted:
            return Error("aborted", f"request {rid!r} was aborted")
        total = len(rec.prompt_token_ids) + len(rec.output_token_ids)
        if rec.start_position < 0 or not 0 <= rec.cached_tokens <= total:
            return Error("bad_request", f"start_position {rec.start_position} must be >= 0 "
                                        f"and cached_tokens {rec.cached_tokens} in [0, {total}]")
        refusal = role.overloaded()
        if refusal is not None:
            return refusal
        now = time.monotonic()
        stream = role.streams[rid] = Stream(
            rid, rec.stream_addr, rec.start_position, rec.prompt_token_ids, rec.cache_salt,
            rec.start_position + len(rec.output_token_ids),
            span=ctx.tracer.span("decode.request", trace, {
                "request_id": rid, "worker_id": ctx.worker_id, "migrated_from": rec.source_id,
                "prompt_tokens": len(rec.prompt_token_ids)}), arrived=now, first=now)
        try:
            slots = await ctx.loop.run(lambda e: e.reserve_migrated(
                rid, rec.prompt_token_ids, rec.output_token_ids, rec.sampling,
                cache_salt=rec.cache_salt, cached_tokens=rec.cached_tokens))
        except ValueError as exc:
            self._forget(rid, stream)
            return Error("bad_request", str(exc))
        if slots is None:
            self._forget(rid, stream)
            return Error("overloaded", f"{ctx.worker_id}: no free KV blocks", retry_after_s=1.0)
        if role.streams.get(rid) is not stream:  # aborted while reserving
            await ctx.loop.run(lambda e: e.abort(rid))
            return Error("aborted", f"request {rid!r} was aborted")
        lease = ctx.settings.kv_lease_s
        token, transfer = b"", None
        if len(slots.block_ids) > slots.num_cached_blocks:
            token = secrets.token_bytes(16)  # as for a remote prefill: the port is public
            transfer = role.receiver.expect(rid, lease, token=token)
            role.remote[rid] = Remote(slots, transfer, "", now)
        self.pending[rid] = transfer
        task = asyncio.create_task(self._expire(rid, transfer, lease))
        self._expiry.add(task)
        task.add_done_callback(self._expiry.discard)
        return MigrateReady(block_ids=slots.block_ids, skip_blocks=slots.num_cached_blocks,
                            lease_s=lease, kv_advert=role.kv_advert(), kv_token=token)

    async def done(self, rid: str, rec: MigrateDone):
        """Adopt ``rid`` once its KV is all here; Error (and nothing held) otherwise."""
        role, ctx = self.role, self.role.ctx
        if rid not in self.pending:
            return Error("not_found", f"no migration of {rid!r} is pending here")
        transfer = self.pending.pop(rid)
        try:
            if transfer is not None:
                async with asyncio.timeout(ctx.settings.kv_lease_s):
                    await transfer.wait()
            if rid not in role.streams:
                raise TransferError("aborted meanwhile")
            role.remote.pop(rid, None)  # the sink writes nothing more from here
            await ctx.loop.run(lambda e: e.complete_migrated(rid))
        except (TransferError, TimeoutError, ValueError) as exc:
            await self._drop(rid)
            return Error("transfer_failed", str(exc) or type(exc).__name__)
        self.adopted += 1
        ctx.metrics.kv_migrated_in.inc()
        log.info("request adopted with its KV", request_id=rid,
                 bytes=transfer.bytes_received if transfer is not None else 0)
        return Ack(detail="adopted")

    async def _expire(self, rid: str, transfer: Transfer | None, lease: float) -> None:
        """The stopping worker never said MigrateDone (it died): free what was reserved."""
        await asyncio.sleep(lease + 1.0)  # done() waits up to the lease itself
        if self.pending.get(rid, False) is transfer:
            self.pending.pop(rid, None)
            log.warning("migration not completed within its lease", request_id=rid)
            await self._drop(rid)

    async def _drop(self, rid: str) -> None:
        role = self.role
        if role.remote.pop(rid, None) is not None:
            role.receiver.cancel(rid)
        stream = role.streams.pop(rid, None)
        if stream is not None:
            self._forget(rid, stream)
        await role.ctx.loop.run(lambda e: e.abort(rid))

    def _forget(self, rid: str, stream: Stream) -> None:
        if self.role.streams.get(rid) is stream:
            del self.role.streams[rid]
        if stream.span is not None:
            stream.span.end()

    async def close(self) -> None:
        for task in list(self._expiry):
            task.cancel()
        await asyncio.gather(*self._expiry, return_exceptions=True)
