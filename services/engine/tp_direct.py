"""Direct KV sends: every rank of a tensor-parallel prefill engine sends its own KV heads'
slice of each layer straight to the decode worker's data plane, instead of rank 0
gathering every slice and sending all heads alone (``tp_kv.py``).

    rank 0 (prefill worker)                          decode worker (TP=1)
    Prefill(advert says it takes slices) ──► route(request, address, token, block ids)
    STEP_EXPORT plan: [..., direct sends, heads by rank] ─► followers
    per layer: rank 0 ──CHUNK heads [0, h)──────────────► places the slice
               rank r ──CHUNK heads [r·h, (r+1)·h)──────► places the slice
    rank 0 ──FINISH(layers × sending ranks)─────────────► DONE once every head is in

Each rank sends on its own connection, under the transfer's one token and lease, each
chunk checksummed; a rank holding a replicated KV head (more ranks than heads) sends
nothing for it unless it is that head's first holder, so no slice goes twice. Rank 0
learns the route from the prefill worker (``ShardedKVStore.route``) and tells the
followers in the plan of the step that completes the prompt. It applies where the
decode worker's advert says it takes slices (a one-rank engine) on the tcp or shm
backend; everything else (pool exports, a TP decode worker) keeps the gather path.

A follower sends from its own event loop thread (``DirectSender``): a send that fails
aborts that transfer (the decode worker then computes the prompt itself) and never
stops the follower.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

if TYPE_CHECKING:  # the prefill role imports this module; sim workers carry no torch
    from services.engine.tp import ShardShape

log = structlog.get_logger(__name__)

DIRECT_BACKENDS = ("tcp", "shm")  # what followers send on; ucx keeps the gather path


@dataclass(frozen=True, slots=True)
class Route:
    """Where one prompt's KV goes: the decode worker's data-plane address (its scheme
    the backend), the transfer's token, the prompt blocks the destination already has,
    and the destination block ids of the rest."""

    address: str
    token: bytes
    skip_blocks: int
    dest_ids: tuple[int, ...]


Heads = tuple[int, int, int]  # (start, count, total): a Chunk's head slice


def rank_heads(shapes: Sequence[ShardShape], num_kv_heads: int) -> list[Heads | None]:
    """Each rank's head slice to send, or None for a rank whose heads an earlier rank
    holds too (replicated KV heads): every head goes once."""
    out: list[Heads | None] = []
    for r, s in enumerate(shapes):
        first = r == 0 or s.kv_head_start != shapes[r - 1].kv_head_start
        out.append((s.kv_head_start, s.num_kv_heads, num_kv_heads) if first else None)
    return out


def direct_sends(completing, routes: dict[str, Route], block_size: int) -> list[list]:
    """The plan's direct sends for the prompts a step completes that have a route:
    ``[request id, address, token, source block ids, destination block ids]``."""
    sends = []
    for seq in completing:
        route = routes.get(seq.request_id)
        if route is None:
            continue
        blocks = seq.block_table[:-(-seq.num_prompt_tokens // block_size)]
        sends.append([seq.request_id, route.address, route.token,
                      list(blocks[route.skip_blocks:]), list(route.dest_ids)])
    return sends


class DirectSender:
    """A follower's data-plane sender, on an event loop thread of its own, started on
    first use. ``send`` hands a chunk over and returns (the engine thread never waits
    for the network); a failed send aborts its transfer."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sender = None
        self._thread: threading.Thread | None = None
        self.sent_bytes = 0
        self.failed = 0

    def _start(self) -> asyncio.AbstractEventLoop:
        from common.transfer import MultiSender

        loop = asyncio.new_event_loop()
        self._sender = MultiSender()
        self._thread = threading.Thread(target=loop.run_forever, name="tp-direct-kv",
                                        daemon=True)
        self._thread.start()
        self._loop = loop
        return loop

    def send(self, address: str, rid: str, layer: int, dest_ids: list[int],
             payload: memoryview, token: bytes, heads: Heads) -> None:
        loop = self._loop or self._start()
        asyncio.run_coroutine_threadsafe(
            self._send(address, rid, layer, dest_ids, payload, token, heads), loop)

    async def _send(self, address, rid, layer, dest_ids, payload, token, heads) -> None:
        try:
            await self._sender.send(address, rid, layer, dest_ids, payload, token=token,
                                    heads=heads)
            self.sent_bytes += payload.nbytes
        except Exception as exc:  # noqa: BLE001 - a transfer's failure, not this rank's
            self.failed += 1
            log.warning("direct KV send failed", request_id=rid, layer=layer,
                        error=str(exc))
            with contextlib.suppress(Exception):
                await self._sender.abort(address, rid, f"tensor-parallel rank's slice: "
                                         f"{exc}", token=token)

    def close(self) -> None:
        loop = self._loop
        if loop is None:
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._sender.close(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(5)
