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
decode worker's advert says it takes slices, on any backend (tcp, shm, ucx): a one-rank
decode worker takes every head; a TP decode worker whose advert lists its ranks
(``KVAdvert.ranks``, ``tp_recv.py``) takes on each rank the heads that rank holds, so a
prefill rank may feed several decode ranks and the reverse (``plan_targets``), the heads
numbered as the receiving rank holds them. Everything else (pool exports, a TP decode
worker without ranks listed, or whose ranks lack the chosen backend) keeps the gather
path.

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

DIRECT_BACKENDS = ("tcp", "shm", "ucx")  # what followers send on (each its own endpoint)


@dataclass(frozen=True, slots=True)
class Route:
    """Where one prompt's KV goes: the decode worker's data-plane address (its scheme
    the backend), the transfer's token, the prompt blocks the destination already has,
    the destination block ids of the rest, and which rank sends which heads to which of
    the decode worker's receivers (one per rank of a TP decode worker, ``tp_recv.py``)."""

    address: str
    token: bytes
    skip_blocks: int
    dest_ids: tuple[int, ...]
    targets: tuple[Target, ...] = ()  # empty: every rank's heads to ``address``


Heads = tuple[int, int, int]  # (start, count, total): a Chunk's head slice
# (sending rank, receiver's address, first of the sender's own heads, count, the heads as
# the receiver numbers them): one slice of each layer one rank sends to one receiver.
Target = tuple[int, str, int, int, Heads]


def plan_targets(senders: Sequence[Heads | None],
                 receivers: Sequence[tuple[str, int, int]]) -> list[Target]:
    """Which rank sends which heads to which receiver: ``senders`` is each sending
    rank's heads (``rank_heads``), ``receivers`` each receiving rank's (address, first
    head, head count). A sender feeds every receiver whose heads overlap its own, and a
    receiver takes from every such sender; each head goes to each receiver once."""
    out: list[Target] = []
    for r, held in enumerate(senders):
        if held is None:
            continue
        a, c, _ = held
        for address, b, d in receivers:
            lo, hi = max(a, b), min(a + c, b + d)
            if lo < hi:
                out.append((r, address, lo - a, hi - lo, (lo - b, hi - lo, d)))
    return out


def chunks_per_receiver(targets: Sequence[Target], num_layers: int) -> dict[str, int]:
    """The chunks each receiver's FINISH counts: one per layer per slice sent to it."""
    counts: dict[str, int] = {}
    for t in targets:
        counts[t[1]] = counts.get(t[1], 0) + num_layers
    return counts


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
    ``[request id, token, source block ids, destination block ids, targets]``."""
    sends = []
    for seq in completing:
        route = routes.get(seq.request_id)
        if route is None:
            continue
        blocks = seq.block_table[:-(-seq.num_prompt_tokens // block_size)]
        sends.append([seq.request_id, route.token, list(blocks[route.skip_blocks:]),
                      list(route.dest_ids), [list(t) for t in route.targets]])
    return sends


def split_heads(payload: memoryview, held: int, first: int, count: int,
                rows: int) -> memoryview:
    """Heads ``[first, first + count)`` of a layer's ``[2, n, token, held heads, width]``
    bytes (``rows`` = 2 · n · token), as contiguous bytes; ``payload`` itself when that is
    every head."""
    if (first == 0 and count == held) or not rows:
        return payload
    import numpy as np

    full = np.frombuffer(payload, dtype=np.uint8).reshape(rows, held, -1)
    return memoryview(np.ascontiguousarray(full[:, first:first + count])).cast("B")


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
