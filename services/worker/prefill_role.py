"""The prefill role: compute a prompt, send its first token to the gateway and its KV to
the decode worker that asked.

    decode ──Prefill(block ids)──► prefill worker
                                   │ run the prompt (chunked), sample token 0
                                   ├──Tokens(position 0)──► gateway
                                   ├──KV, one payload per layer──► decode's data plane
                                   └──PrefillDone(first token)──► decode (the reply)

The request's blocks are held until every layer is sent, then released; they stay in
the local prefix cache for the next prompt that shares them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from typing import TYPE_CHECKING

import structlog
import torch

from common.protocol import Error, Prefill, PrefillDone, Tokens
from common.transfer import TransferError
from services.engine.outputs import RequestOutput
from services.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from services.worker.server import Worker

log = structlog.get_logger(__name__)


def prefill_params(sampling: dict) -> SamplingParams:
    """The request's sampling, cut to the one token prefill produces."""
    params = SamplingParams.from_dict(sampling)
    return dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))


class PrefillRole:
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.waiters: dict[str, asyncio.Future] = {}
        self.sent_bytes = 0
        self.done = 0

    def on_output(self, out) -> bool:
        """Claim a finished prefill's output; False if it is not ours."""
        fut = self.waiters.get(out.request_id)
        if fut is None:
            return False
        if out.finished and not fut.done():
            fut.set_result(out)
        return True

    async def handle(self, rid: str, rec: Prefill):
        w = self.worker
        try:
            params = prefill_params(rec.sampling)
        except ValueError as exc:
            return Error("bad_request", str(exc))
        fut = asyncio.get_running_loop().create_future()
        self.waiters[rid] = fut
        engine = w.engine
        try:
            try:
                await w.loop.call(engine.add_request, rid, rec.prompt_token_ids, params,
                                  cache_salt=rec.cache_salt, hold_blocks=True)
            except ValueError as exc:
                return Error("bad_request", str(exc))
            out = await fut
            if out.finish_reason in ("abort", "error") or not out.new_token_ids:
                await self._abort_transfer(rec, rid, f"prefill {out.finish_reason}")
                return Error("aborted", f"prefill ended with {out.finish_reason}")
            first = out.new_token_ids[0]
            w.streams.send(rec.stream_addr, rid, Tokens(
                position=0, token_ids=[first], prompt_tokens=out.num_prompt_tokens,
                cached_tokens=out.num_cached_tokens, source="prefill",
                logprobs=w.logprob_dicts(out.new_logprobs)))
            chunks = await self._send_kv(rid, rec)
            self.done += 1
            return PrefillDone(first_token=first, num_chunks=chunks,
                               cached_tokens=out.num_cached_tokens)
        except (TransferError, OSError) as exc:
            log.warning("KV send failed", request_id=rid, error=str(exc))
            await self._abort_transfer(rec, rid, str(exc))
            return Error("transfer_failed", str(exc))
        finally:
            self.waiters.pop(rid, None)
            await w.loop.call(self._drop, rid)

    def _drop(self, rid: str) -> None:
        engine = self.worker.engine
        engine.abort(rid)
        engine.release(rid)

    async def _send_kv(self, rid: str, rec: Prefill) -> int:
        w = self.worker
        blocks = await w.loop.call(w.engine.kv_block_ids, rid)
        if len(blocks) != len(rec.block_ids):
            raise TransferError(f"decode reserved {len(rec.block_ids)} blocks, "
                                f"prompt fills {len(blocks)}")
        src, dest = blocks[rec.skip_blocks:], list(rec.block_ids[rec.skip_blocks:])
        start = time.perf_counter()
        # The held blocks cannot change while we read them, so export off the engine
        # thread and let the engine keep stepping.
        kv = w.engine.kv_cache
        for layer in range(kv.num_layers):
            payload = kv.export_layer(layer, src)
            data = payload.view(torch.uint8).numpy()
            await w.sender.send(rec.kv_addr, rid, layer, dest, memoryview(data).cast("B"))
            self.sent_bytes += data.nbytes
            w.metrics.kv_transfer_bytes.inc(data.nbytes)
        await w.sender.finish(rec.kv_addr, rid, kv.num_layers)
        w.metrics.kv_transfer_seconds.inc(time.perf_counter() - start)
        return kv.num_layers

    async def _abort_transfer(self, rec: Prefill, rid: str, reason: str) -> None:
        with contextlib.suppress(TransferError, OSError):
            await self.worker.sender.abort(rec.kv_addr, rid, reason)

    async def abort(self, rid: str) -> None:
        fut = self.waiters.get(rid)
        if fut is not None and not fut.done():
            await self.worker.loop.call(self.worker.engine.abort, rid)
            if not fut.done():
                fut.set_result(RequestOutput(rid, [], 0, finished=True, finish_reason="abort"))
