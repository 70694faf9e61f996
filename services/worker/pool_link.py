"""A worker's use of the cache pool: pooled prefix blocks in before a prompt is computed,
the blocks it computed out after.

    with_prefix(prompt, call)
        chain   the hashes of the prompt's full blocks, all but its last token (the
                blocks a prefix hit may cover, as the engine's own admission sees them)
        local   how many leading blocks this engine's prefix cache holds
        pooled  how many of the following blocks the pool holds        (PoolExists)
        fetch   them (PoolGet) when that is estimated cheaper than computing them, then
                in one engine call adopt them into the prefix cache and make ``call``
                (add_request, reserve_remote_prefill): admission finds them as ordinary
                prefix hits, so a pooled block and a local one are reused alike
        Every engine access (the local look-up, the adoption, the call, the exports
        below) runs on the engine thread, through the engine loop.
    computed(prompt)
        the prompt's full blocks are computed here: queue the chain for write-back. A
        background task asks the pool which leading blocks it already holds, starts the
        export of the rest from the prefix cache a batch at a time (engine thread; on a
        GPU the copy to the host then runs on a side stream), waits for the bytes on
        another thread and puts them. The queue is bounded; past the bound work is
        dropped (counted), never waited for.

The estimate: fetching n blocks costs ``n * block_bytes / bandwidth``, bandwidth measured
on earlier fetches (``pool_bandwidth_mbs`` until then); computing them costs
``n * block_size / prefill rate``, the rate measured on this engine's prefill steps. Until
a prefill step has been measured, fetching wins.

A pool that is down or slow is a miss: ``PoolClient`` never raises for it, and a request
is then computed as if no pool were configured.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from typing import Any

import structlog

from common.block_hash import hash_blocks
from common.pool.client import PoolClient
from common.pool.discovery import discover_pools, parse_pool_addrs
from common.protocol import WorkerPoolCounts
from services.worker.context import RoleContext
from services.worker.engine_loop import exported_bytes

log = structlog.get_logger(__name__)

EXPORT_BATCH = 16  # blocks per engine call when writing back (bounds the engine's pause)
MAX_QUEUED_BLOCKS = 8192  # write-back backlog; beyond it new work is dropped
DISCOVER_RETRY_S = 1.0
PARTIAL_AFTER_S = 10.0  # use the instances that answered once this long has passed
FETCH_OVERHEAD_S = 1e-3  # a round trip and the engine call, per fetch


class PoolLink:
    def __init__(self, ctx: RoleContext) -> None:
        self.ctx = ctx
        s = ctx.settings
        self.addrs = parse_pool_addrs(s.cache_pools)
        self.client: PoolClient | None = None
        self.bandwidth = s.pool_bandwidth_mbs * 1e6  # bytes/s, refined by each fetch
        self._queue: collections.deque[list[int]] = collections.deque()
        self._queued = 0
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._instances: frozenset[str] = frozenset()
        self.counts = collections.Counter(
            fetches=0, fetched_blocks=0, fetch_skipped=0, written_blocks=0,
            write_back_dropped=0, fetch_bytes=0)
        # Wall time of the pool gets and of the engine adopting what they returned.
        self.seconds = {"fetch_seconds": 0.0, "adopt_seconds": 0.0}

    @property
    def enabled(self) -> bool:
        return bool(self.addrs)

    async def start(self) -> None:
        if self.enabled:
            self._tasks = [asyncio.create_task(self._connect()),
                           asyncio.create_task(self._writer())]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.client is not None:
            await self.client.close()

    def stats(self) -> WorkerPoolCounts:
        return WorkerPoolCounts(**self.counts, **self.seconds,
                                instances=sorted(self._instances),
                                write_back_queued=self._queued)

    # ---- in: fetch and adopt --------------------------------------------------------

    def _chain(self, prompt: list[int], salt: str | None, num_tokens: int) -> list[int]:
        facts = self.ctx.loop.facts
        bs = facts.block_size
        return hash_blocks(prompt[: num_tokens // bs * bs], bs, facts.fingerprint, salt)

    async def with_prefix(self, prompt: list[int], salt: str | None,
                          call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``call(engine, *args, **kwargs)`` on the engine thread, the prompt's pooled
        prefix blocks adopted into the prefix cache first (in the same engine call)."""
        loop = self.ctx.loop
        fetched = await self._fetch(prompt, salt) if self.client is not None else None
        if fetched is None:
            return await loop.run(call, *args, **kwargs)

        def adopt_then_call(engine):
            start = time.perf_counter()
            try:
                adopted = engine.pool_blocks.adopt(*fetched)
            except ValueError as exc:  # a block of another layout: a miss
                log.warning("pool_blocks_rejected", error=str(exc))
                adopted = 0
            self.seconds["adopt_seconds"] += time.perf_counter() - start
            self.counts["fetched_blocks"] += adopted
            return call(engine, *args, **kwargs)

        return await loop.run(adopt_then_call)

    async def _fetch(self, prompt: list[int], salt: str | None):
        """``pool_blocks.adopt`` arguments ``(chain, prompt, start, blocks)`` worth adopting,
        or None."""
        s = self.ctx.settings
        chain = self._chain(prompt, salt, len(prompt) - 1)
        # A hint only: the engine call that adopts checks the prefix again.
        local = await self.ctx.loop.run(cached_prefix_blocks, chain)
        rest = chain[local:]
        if len(rest) < s.pool_min_fetch_blocks:
            return None
        held = await self.client.exists(rest)
        if held < s.pool_min_fetch_blocks:
            return None
        if not self._worth_fetching(held):
            self.counts["fetch_skipped"] += 1
            return None
        start = time.perf_counter()
        blocks = await self.client.get(rest[:held])
        if not blocks:
            return None
        nbytes = sum(len(b) for b in blocks)
        elapsed = time.perf_counter() - start
        if elapsed > 0:
            self.bandwidth = 0.7 * self.bandwidth + 0.3 * nbytes / elapsed
        self.counts["fetches"] += 1
        self.counts["fetch_bytes"] += nbytes
        self.seconds["fetch_seconds"] += elapsed
        return chain, prompt, local, blocks

    def _worth_fetching(self, n: int) -> bool:
        loop = self.ctx.loop
        rate = loop.prefill_tokens_per_s
        if not rate:
            return True
        fetch_s = FETCH_OVERHEAD_S + n * loop.facts.block_nbytes / self.bandwidth
        compute_s = n * loop.facts.block_size / rate
        return fetch_s < compute_s

    # ---- out: write back -------------------------------------------------------------

    def computed(self, prompt: list[int], salt: str | None) -> None:
        """The prompt's KV was computed here: write its full blocks back, in the
        background."""
        if self.client is None or not self.ctx.settings.pool_write_back:
            return
        chain = self._chain(prompt, salt, len(prompt))
        if not chain:
            return
        if self._queued + len(chain) > MAX_QUEUED_BLOCKS:
            self.counts["write_back_dropped"] += len(chain)
            return
        self._queue.append(chain)
        self._queued += len(chain)
        self._wake.set()

    async def _writer(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                chain = self._queue.popleft()
                self._queued -= len(chain)
                try:
                    await self._write(chain)
                except Exception as exc:  # write-back is best effort; keep serving
                    log.warning("pool_write_back_failed", error=str(exc))

    async def _write(self, chain: list[int]) -> None:
        held = await self.client.exists(chain)
        for first in range(held, len(chain), EXPORT_BATCH):
            batch = chain[first:first + EXPORT_BATCH]
            started = await self.ctx.loop.run(export_blocks, batch)
            blocks = await exported_bytes(started) if started.count else []
            if blocks:
                await self.client.put([(key, data, first + i) for i, (key, data)
                                       in enumerate(zip(batch, blocks, strict=False))])
                self.counts["written_blocks"] += len(blocks)
            if len(blocks) < len(batch):  # evicted here meanwhile: the chain ends
                return

    # ---- discovery -------------------------------------------------------------------

    async def _connect(self) -> None:
        """Find the instances; use them all, or those found after PARTIAL_AFTER_S, and
        keep looking until every configured one has answered."""
        s = self.ctx.settings
        began = time.monotonic()
        while True:
            found = await discover_pools(self.ctx.zmq, self.addrs)
            ids = frozenset(found)
            complete = len(found) == len(self.addrs)
            if ids and ids != self._instances and (
                    complete or time.monotonic() - began > PARTIAL_AFTER_S):
                old = self.client
                self.client = PoolClient(
                    self.ctx.zmq, {i: v.control_addr for i, v in found.items()},
                    replicas=min(s.pool_replicas, len(found)),
                    timeout_s=s.pool_timeout_s, name=f"{self.ctx.worker_id}-pool",
                    transfer_backend=s.transfer_backend, host_id=s.resolved_host_id)
                self._instances = ids
                log.info("cache pool connected", instances=sorted(ids),
                         missing=len(self.addrs) - len(found))
                if old is not None:
                    await old.close()
            if complete:
                return
            await asyncio.sleep(DISCOVER_RETRY_S)


def cached_prefix_blocks(engine, chain: list[int]) -> int:
    """Engine thread: how many leading blocks of ``chain`` the prefix cache holds."""
    cached = engine.block_manager
    local = 0
    while local < len(chain) and cached.block_for_hash(chain[local]) is not None:
        local += 1
    return local


def export_blocks(engine, hashes: list[int]):
    """Engine thread: the export of the cached blocks of ``hashes`` started
    (``PoolBlocks.export_async``); their bytes are waited for off this thread."""
    return engine.pool_blocks.export_async(hashes)
