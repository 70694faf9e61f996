"""The KV of a tensor-parallel engine in the one layout every engine shares (all heads).

Each rank's cache holds its KV heads' slice of every block (``tp.shard_shape``); the
data plane and the cache pool carry the TP=1 layout (``kv_cache.py``), so a TP=2
prefill worker feeds a TP=1 decode worker, and a block pooled by one is read by the
other. Rank 0 gathers the slices into that layout for an export and scatters them for
an import, over a gloo group of its own (``tp_group.join_group``), on one host.

A prefill worker's KV for a decode worker that takes head slices skips the gather:
each rank sends its own slice on the data plane (``tp_direct.py``). The gather stays
for the rest (pool exports, a decode worker listing no ranks, ucx), where one sender
and the all-heads layout are what the other side takes. Either way every slice is
sent once, so the bytes on the wire equal the model's KV for the prompt.

Followers take part through the plans rank 0 broadcasts (``tp_group``), so every
collective runs in the same order on every rank:

    STEP_EXPORT  a step that completes prompts: after each layer, every rank sends its
                 slice of those prompts' blocks to rank 0, which hands the layer's
                 export out of what it gathered (the prefill worker's per-layer stream);
                 or, for a prompt with a route, every rank sends its slice straight
                 to the decode worker (``tp_direct.py``)
    KV_OUT       an export between steps (the pool's blocks; a layer outside a step)
    KV_IN        imports: rank 0 scatters each op's slices

Imports arrive off the engine thread (the data plane's sink), where no collective may
run: rank 0 keeps a copy and applies them, on every rank, before the next step or KV
operation, in the order they came (``ShardedKVStore.flush``). Until then no one reads
those blocks: they are reserved for a request waiting for its KV, or being adopted.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import msgpack
import torch
import torch.distributed as dist

from services.engine.kv_cache import KVCache
from services.engine.kv_store import Buffer
from services.engine.tp import ShardShape
from services.engine.tp_direct import DirectSender, Route, plan_targets, rank_heads
from services.engine.tp_recv import LeaderReceive


class _Posted(NamedTuple):
    """A gather in flight: the buffers live until it completes."""

    layer: int
    work: Any  # torch.distributed's Work
    mine: torch.Tensor
    parts: list[torch.Tensor]


BLOCKS = -1  # an op's layer for whole blocks (every layer), the pool's unit
Op = tuple[int, list[int]]  # (layer or BLOCKS, block ids)


def pack_ops(ops: Sequence[Op]) -> bytes:
    return msgpack.packb([[layer, list(ids)] for layer, ids in ops], use_bin_type=True)


def unpack_ops(data: bytes) -> list[Op]:
    return [(int(layer), [int(i) for i in ids]) for layer, ids in msgpack.unpackb(data)]


def local_slice(cache: KVCache, op: Op) -> torch.Tensor:
    """This rank's heads of ``op`` as host bytes, the head axis second to last:
    ``[2, n, token, heads, head_dim*itemsize]`` for a layer, ``[n, layer, 2, token,
    heads, head_dim*itemsize]`` for blocks."""
    layer, ids = op
    if layer == BLOCKS:
        cache.check_ids(ids)
        t = torch.stack([torch.stack([cache.k[:, i], cache.v[:, i]], dim=1) for i in ids])
    elif cache.k.device.type == "cpu":  # one copy, where export_layer stacks two
        idx = torch.tensor(cache.check_ids(ids), dtype=torch.long)
        t = cache.k.new_empty((2, len(ids), *cache.k.shape[2:]))
        torch.index_select(cache.k[layer], 0, idx, out=t[0])
        torch.index_select(cache.v[layer], 0, idx, out=t[1])
    else:
        t = cache.export_layer(layer, ids)
    return t.contiguous().cpu().view(torch.uint8)


def slice_shape(cache: KVCache, op: Op) -> tuple[int, ...]:
    layer, ids = op
    heads, width = cache.k.shape[3], cache.k.shape[4] * cache.k.element_size()
    token = (cache.block_size, heads, width)
    return (len(ids), cache.num_layers, 2, *token) if layer == BLOCKS else (2, len(ids), *token)


def apply_slice(cache: KVCache, op: Op, part: torch.Tensor) -> None:
    """Write this rank's heads (bytes from ``local_slice``'s layout) into ``op``'s blocks."""
    layer, ids = op
    values = part.view(cache.k.dtype).to(cache.k.device)
    if layer != BLOCKS:
        cache.import_layer(layer, ids, values)
        return
    cache.check_ids(ids)
    for n, i in enumerate(ids):
        cache.k[:, i].copy_(values[n, :, 0])
        cache.v[:, i].copy_(values[n, :, 1])


class FollowerKV:
    """A follower's side of the gathers and scatters."""

    def __init__(self, cache: KVCache, group, rank: int) -> None:
        self.cache = cache
        self.group = group
        self.rank = rank
        self.direct = DirectSender()
        self._posted: collections.deque[tuple[Any, torch.Tensor]] = collections.deque()

    def gather(self, op: Op) -> None:
        dist.gather(local_slice(self.cache, op), None, dst=0, group=self.group)

    def step_hook(self, block_ids: list[int],
                  direct: Sequence[list] = ()) -> Callable[[int], None]:
        """Post this rank's slice of each layer of ``block_ids`` as it is computed (rank
        0 collects it a layer later), at most two in flight, ``end_step`` waiting for
        the rest; and send its slices of each ``direct`` prompt to the decode worker's
        receivers its targets name (``tp_direct.plan_targets``)."""
        sends = [(rid, token, src, dest, [t for t in targets if t[0] == self.rank])
                 for rid, token, src, dest, targets in direct]
        sends = [m for m in sends if m[4]]

        def hook(layer: int) -> None:
            if block_ids:
                mine = local_slice(self.cache, (layer, block_ids))
                self._posted.append((dist.gather(mine, None, dst=0, group=self.group,
                                                 async_op=True), mine))
                while len(self._posted) > 2:
                    self._posted.popleft()[0].wait()
            for rid, token, src, dest, targets in sends:
                held = local_slice(self.cache, (layer, src))
                for _, address, first, count, heads in targets:
                    payload = _bytes(held if count == held.shape[-2]
                                     else held[..., first:first + count, :])
                    self.direct.send(address, rid, layer, dest, payload, token, tuple(heads))
        return hook

    def end_step(self) -> None:
        while self._posted:
            self._posted.popleft()[0].wait()

    def export(self, ops: list[Op]) -> None:
        for op in ops:
            self.gather(op)

    def import_(self, ops: list[Op]) -> None:
        for op in ops:
            part = torch.empty(slice_shape(self.cache, op), dtype=torch.uint8)
            dist.scatter(part, None, src=0, group=self.group)
            apply_slice(self.cache, op, part)


class ShardedKVStore:
    """Rank 0's ``KVStore`` over every rank's slice: exports and imports the TP=1 layout.

    ``send_plan(payload, kind)`` tells the followers (raising ``EngineDeadError`` when
    the group is gone); ``broken(what, exc)`` turns a failed collective into one."""

    def __init__(self, local: KVCache, shapes: Sequence[ShardShape], num_kv_heads: int,
                 group, send_plan: Callable[[bytes, int], None],
                 broken: Callable[[str, BaseException], Exception],
                 receive: LeaderReceive | None = None) -> None:
        self.local = local
        # Each rank receiving its own heads' slices (tp_recv.py); None: rank 0 takes all.
        self.receive = receive if len(shapes) <= num_kv_heads else None
        self.num_layers, self.num_blocks = local.num_layers, local.num_blocks
        self.block_size = local.block_size
        self.num_kv_heads = num_kv_heads
        self._shapes = list(shapes)
        # One rank per KV head: with more ranks than heads, a head's first holder.
        self._owners = [r for r, s in enumerate(shapes)
                        if r == 0 or s.kv_head_start != shapes[r - 1].kv_head_start]
        self._group = group
        self._send_plan = send_plan
        self._broken = broken
        self._pending: collections.deque[tuple[Op, torch.Tensor]] = collections.deque()
        self._staged: tuple[int, dict[int, int], torch.Tensor] | None = None
        self._in_step = False
        self._export_ids: list[int] = []
        self._index: dict[int, int] = {}
        self._posted: _Posted | None = None
        self._deliver_to: Callable[[int], None] | None = None
        # Prompts whose KV every rank sends straight to the decode worker (tp_direct.py).
        self.routes: dict[str, Route] = {}
        self.heads_by_rank = rank_heads(shapes, num_kv_heads)
        # Rank 0's engine thread in gathers for a step's stream (slices, waits, layout).
        self.handoff_seconds = 0.0
        local_heads = local.k.shape[3]
        self._layer_block_nbytes = local.block_nbytes // local.num_layers // local_heads \
            * num_kv_heads

    @property
    def block_nbytes(self) -> int:
        return self._layer_block_nbytes * self.num_layers

    @property
    def sending_ranks(self) -> int:
        """Ranks that send a slice of each layer on the direct path."""
        return sum(h is not None for h in self.heads_by_rank)

    def route(self, request_id: str, route: Route) -> None:
        """Send ``request_id``'s KV on the direct path (without targets: every rank's
        heads to ``route.address``). Engine thread."""
        if not route.targets:
            route = dataclasses.replace(route, targets=tuple(plan_targets(
                self.heads_by_rank, [(route.address, 0, self.num_kv_heads)])))
        self.routes[request_id] = route

    def unroute(self, request_id: str) -> None:
        self.routes.pop(request_id, None)

    def rank_heads(self) -> list[tuple[int, int]]:
        """(first KV head, count) each rank's blocks hold, rank 0 first."""
        return [(s.kv_head_start, s.num_kv_heads) for s in self._shapes]

    def import_layer_slice_bytes(self, layer: int, block_ids: Sequence[int],
                                 heads: tuple[int, int, int], payload: Buffer) -> None:
        """Rank 0's own heads' slice, numbered within its heads (``tp_recv.py``), written
        into its blocks now, under ``EngineLoop.import_layer``'s rules."""
        self.local.import_layer_slice_bytes(layer, block_ids, heads, payload)

    def export_local_layer(self, layer: int, block_ids: Sequence[int]) -> memoryview:
        """Rank 0's own heads of ``layer`` for ``block_ids`` (``heads_by_rank[0]``), the
        direct path's payload: ``[2, n, token, heads, head_dim]`` bytes."""
        return _bytes(local_slice(self.local, (layer, [int(i) for i in block_ids])))

    def close(self) -> None:
        """Free this rank's KV export buffers."""
        self.local.close()

    # ---- collectives (engine thread) --------------------------------------------------

    def _post_gather(self, op: Op) -> _Posted:
        """Start gathering ``op``'s slices from every rank (the followers post theirs at
        the same point of their plan)."""
        mine = local_slice(self.local, op)
        parts = [torch.empty_like(mine) for _ in self._shapes]
        try:
            work = dist.gather(mine, parts, dst=0, group=self._group, async_op=True)
        except RuntimeError as exc:
            raise self._broken("gathering KV from the followers", exc) from exc
        return _Posted(op[0], work, mine, parts)

    def _finish_gather(self, posted: _Posted) -> torch.Tensor:
        """Wait for a posted gather; its slices in the all-heads layout."""
        try:
            posted.work.wait()
        except RuntimeError as exc:
            raise self._broken("gathering KV from the followers", exc) from exc
        return torch.cat([posted.parts[r] for r in self._owners], dim=-2)

    def _gather(self, op: Op) -> torch.Tensor:
        return self._finish_gather(self._post_gather(op))

    def _scatter(self, op: Op, full: torch.Tensor) -> None:
        parts = [full[..., s.kv_head_start:s.kv_head_start + s.num_kv_heads, :].contiguous()
                 for s in self._shapes]
        mine = torch.empty_like(parts[0])
        try:
            dist.scatter(mine, parts, src=0, group=self._group)
        except RuntimeError as exc:
            raise self._broken("scattering KV to the followers", exc) from exc
        apply_slice(self.local, op, mine)

    def flush(self) -> None:
        """Apply the imports received so far on every rank, in order. Engine thread."""
        from services.engine.tp_group import KV_IN

        if not self._pending:
            return
        batch = []
        while self._pending:
            batch.append(self._pending.popleft())
        self._send_plan(pack_ops([op for op, _ in batch]), KV_IN)
        for op, full in batch:
            self._scatter(op, full)

    def _export(self, op: Op) -> torch.Tensor:
        from services.engine.tp_group import KV_OUT

        if self._in_step:
            raise RuntimeError("during a step only the blocks of prompts it completes "
                               "can be exported")
        self.flush()
        self._send_plan(pack_ops([op]), KV_OUT)
        return self._gather(op)

    # ---- a step that streams its prompts' KV out ----------------------------------------

    def begin_step(self, export_ids: list[int]) -> None:
        self._in_step = True
        self._staged = None
        self._posted = None
        self._export_ids = export_ids

    def end_step(self, deliver: bool = False) -> None:
        """End a step. ``deliver`` (the forward succeeded): first hand out the last
        layer, whose gather is still in flight."""
        posted, self._posted = self._posted, None
        try:
            if deliver and posted is not None and self._deliver_to is not None:
                self._deliver(posted, self._deliver_to)
        finally:
            self._in_step = False
            self._staged = None
            self._deliver_to = None

    def staging_hook(self, layer_hook: Callable[[int], None]) -> Callable[[int], None]:
        """``layer_hook`` fed from gathers of the step's export blocks, one layer behind:
        after layer L every rank posts its slice of L (``async_op``, so no rank waits
        for the others there), and rank 0 hands out layer L-1, whose slices came in
        while L computed. ``end_step(deliver=True)`` hands out the last layer."""
        ids = self._export_ids
        self._index = {b: i for i, b in enumerate(ids)}
        self._deliver_to = layer_hook

        def hook(layer: int) -> None:
            start = time.perf_counter()
            previous, self._posted = self._posted, self._post_gather((layer, ids))
            self.handoff_seconds += time.perf_counter() - start
            if previous is not None:
                self._deliver(previous, layer_hook)
        return hook

    def _deliver(self, posted: _Posted, layer_hook: Callable[[int], None]) -> None:
        start = time.perf_counter()
        full = self._finish_gather(posted)
        self._staged = (posted.layer, self._index, full)
        self.handoff_seconds += time.perf_counter() - start
        layer_hook(posted.layer)

    # ---- the KVStore contract -----------------------------------------------------------

    def export_layer_bytes(self, layer: int, block_ids: Sequence[int]) -> memoryview:
        ids = [int(i) for i in block_ids]
        staged = self._staged
        if staged is not None and staged[0] == layer and all(i in staged[1] for i in ids):
            rows = [staged[1][i] for i in ids]
            first = rows[0] if rows else 0
            if rows == list(range(first, first + len(rows))):  # a run: no gather by index
                full = staged[2]
                return _bytes(full if len(rows) == full.shape[1]
                              else full.narrow(1, first, len(rows)))
            return _bytes(staged[2].index_select(1, torch.tensor(rows, dtype=torch.long)))
        self.local.check_ids(ids)
        if not ids:
            return memoryview(bytearray())
        return _bytes(self._export((layer, ids)))

    def import_layer_bytes(self, layer: int, block_ids: Sequence[int],
                           payload: Buffer) -> None:
        """Checked and copied now; written on the ranks at the next ``flush``."""
        ids = [int(i) for i in block_ids]
        self.local.check_ids(ids)
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} outside 0..{self.num_layers - 1}")
        shape = (2, len(ids), *self._full_token_shape())
        copy = _copy(payload, shape)
        if ids:
            self._pending.append(((layer, ids), copy))

    def export_block_bytes(self, block_id: int) -> memoryview:
        self.local.check_ids([block_id])
        return _bytes(self._export((BLOCKS, [int(block_id)])))

    def import_block_bytes(self, block_id: int, data: Buffer) -> None:
        self.local.check_ids([block_id])
        shape = (1, self.num_layers, 2, *self._full_token_shape())
        self._pending.append(((BLOCKS, [int(block_id)]), _copy(data, shape)))

    def _full_token_shape(self) -> tuple[int, int, int]:
        k = self.local.k
        return self.block_size, self.num_kv_heads, k.shape[4] * k.element_size()


def _copy(data: Buffer, shape: tuple[int, ...]) -> torch.Tensor:
    """``data``'s bytes as a new uint8 tensor of ``shape``; ValueError if they do not fit."""
    view = memoryview(data).cast("B")
    want = 1
    for n in shape:
        want *= n
    if view.nbytes != want:
        raise ValueError(f"KV payload of {view.nbytes} bytes where {want} fit "
                         f"{shape[:-3]} blocks of this model")
    return torch.frombuffer(bytearray(view), dtype=torch.uint8).view(shape) if want else \
        torch.empty(shape, dtype=torch.uint8)


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().numpy()).cast("B")
