"""The tiered block store: DRAM in front of an optional SSD tier.

    put_many ──► DRAM ──(evicted)──► SSD ──(evicted)──► gone  (on_removed)
    get_many ◄── DRAM hit
             ◄── SSD hit, checksum verified ──(promoted)──► DRAM
    exists_prefix: longest run of leading keys held by either tier

Tiers are inclusive on the way up: a block promoted from SSD keeps its SSD copy, so its
next demotion costs no write (SSD writes are the expensive, wearing operation, and the
SSD tier is the larger one). New blocks enter DRAM only; they reach SSD when DRAM evicts
them (write-back), so a block still only in DRAM does not survive a restart.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import structlog

from common.pool.keys import Buffer, check_block, check_key
from services.cache_pool.block import Evicted
from services.cache_pool.tiers import DramTier, SsdTier

log = structlog.get_logger(__name__)

KeysCallback = Callable[[list[int]], None]


class StoreStats(NamedTuple):
    dram_hits: int
    ssd_hits: int
    misses: int
    dram_blocks: int
    ssd_blocks: int
    dram_bytes: int
    ssd_bytes: int
    dram_evictions: int   # blocks DRAM evicted (each demoted when there is an SSD tier)
    ssd_evictions: int    # blocks SSD evicted to make room
    corrupt_dropped: int  # SSD blocks dropped on a failed checksum or missing file
    demotion_failures: int  # demotions the SSD tier refused (too big, I/O error)


class BlockStore:
    """Blocks by key across a DRAM tier and an optional SSD tier.

    Contract:
    - ``put_many`` validates every item (key, bytes-like data no larger than the DRAM
      block size, depth) before storing any; on a bad item it raises and changes nothing.
      A key already held counts as a use and is not rewritten.
    - ``get_many`` returns copies (``bytes``, or what its ``copy`` makes), one per key,
      None for a miss; a hit is a use in the tier that served it; an SSD hit is
      promoted into DRAM.
    - ``exists_prefix`` and ``where`` are queries: no use is recorded, no checksum read.
    - ``on_stored(keys)`` runs once per call, after the store is consistent, with the keys
      that were in no tier before the call and are in one after it; ``on_removed(keys)``
      with those that were held and are in no tier after it (a block that moves from DRAM
      to SSD is neither). Keys are in the order the call first touched them.
    - A demotion the SSD tier cannot take (I/O error, block larger than its capacity)
      drops the block, logs a warning and is counted; the call itself does not fail.
    """

    def __init__(self, dram: DramTier, ssd: SsdTier | None = None, *,
                 on_stored: KeysCallback | None = None,
                 on_removed: KeysCallback | None = None) -> None:
        self.dram = dram
        self.ssd = ssd
        self.on_stored = on_stored
        self.on_removed = on_removed
        self._hits = {"dram": 0, "ssd": 0}
        self._misses = 0
        self._demotion_failures = 0
        self._changed: dict[int, bool] = {}  # key -> held before this call

    # -- queries ------------------------------------------------------------------------

    def held(self, key: int) -> bool:
        return key in self.dram or (self.ssd is not None and key in self.ssd)

    def where(self, key: int) -> tuple[str, ...]:
        """The tiers holding ``key``, from ("dram", "ssd")."""
        tiers = ("dram",) if key in self.dram else ()
        return tiers + (("ssd",) if self.ssd is not None and key in self.ssd else ())

    def exists_prefix(self, keys: Sequence[int]) -> int:
        """Length of the longest prefix of the hash chain ``keys`` held by either tier."""
        for i, key in enumerate(keys):
            if not self.held(key):
                return i
        return len(keys)

    def stats(self) -> StoreStats:
        ssd = self.ssd
        has_ssd = ssd is not None  # not ``bool(ssd)``: an empty tier is falsy
        return StoreStats(
            dram_hits=self._hits["dram"], ssd_hits=self._hits["ssd"], misses=self._misses,
            dram_blocks=len(self.dram), ssd_blocks=len(ssd) if has_ssd else 0,
            dram_bytes=self.dram.used_bytes, ssd_bytes=ssd.used_bytes if has_ssd else 0,
            dram_evictions=self.dram.evictions, ssd_evictions=ssd.evictions if has_ssd else 0,
            corrupt_dropped=ssd.corrupt_dropped if has_ssd else 0,
            demotion_failures=self._demotion_failures)

    # -- mutations ----------------------------------------------------------------------

    def put_many(self, items: Sequence[tuple[int, Buffer, int]]) -> None:
        """Store ``(key, data, depth)`` blocks in DRAM, demoting what DRAM evicts."""
        for key, data, depth in items:
            size = len(check_block(key, data, depth))
            if size > self.dram.block_bytes:
                raise ValueError(f"block {key:#x} of {size} bytes exceeds "
                                 f"block_bytes {self.dram.block_bytes}")
        try:
            for key, data, depth in items:
                self._note(key)
                self._demote(self.dram.put(key, data, depth))
        finally:
            self._publish()

    def get_many(self, keys: Sequence[int],
                 copy: Callable[[memoryview], Buffer] = bytes) -> list[Buffer | None]:
        """``copy`` makes each DRAM hit's copy (an SSD hit is one already)."""
        for key in keys:
            check_key(key)
        out: list[Buffer | None] = []
        try:
            for key in keys:
                view = self.dram.get(key)
                if view is not None:
                    self._hits["dram"] += 1
                    out.append(copy(view))  # the slot may be reused by a promotion below
                    continue
                data = self._get_ssd(key)
                if data is None:
                    self._misses += 1
                else:
                    self._hits["ssd"] += 1
                    if len(data) <= self.dram.block_bytes:  # else: served, not promoted
                        self._demote(self.dram.put(key, data, self.ssd.depth(key)))
                out.append(data)
        finally:
            self._publish()
        return out

    def remove_many(self, keys: Iterable[int]) -> int:
        """Drop ``keys`` from every tier; returns how many were held. Unknown keys are
        ignored."""
        keys = list(keys)
        for key in keys:
            check_key(key)
        removed = 0
        try:
            for key in keys:
                self._note(key)
                in_dram = self.dram.remove(key)
                in_ssd = self.ssd is not None and self.ssd.remove(key)
                removed += in_dram or in_ssd
        finally:
            self._publish()
        return removed

    # -- internals ----------------------------------------------------------------------

    def _get_ssd(self, key: int) -> bytes | None:
        if self.ssd is None or key not in self.ssd:
            return None
        self._note(key)  # a corrupt block is dropped by the read
        return self.ssd.get(key)

    def _demote(self, evicted: list[Evicted]) -> None:
        for block in evicted:
            self._note(block.key, held=True)
            if self.ssd is None:
                continue
            try:
                dropped = self.ssd.put(block.key, block.data, block.depth)
            except (OSError, ValueError) as e:
                self._demotion_failures += 1
                log.warning("demotion_failed", key=f"{block.key:016x}", error=str(e))
                continue
            for key in dropped:
                self._note(key, held=True)

    def _note(self, key: int, held: bool | None = None) -> None:
        """Remember whether ``key`` was held before this call first changed it."""
        if key not in self._changed:
            self._changed[key] = self.held(key) if held is None else held

    def _publish(self) -> None:
        changed, self._changed = self._changed, {}
        stored = [k for k, before in changed.items() if not before and self.held(k)]
        removed = [k for k, before in changed.items() if before and not self.held(k)]
        if stored and self.on_stored is not None:
            self.on_stored(stored)
        if removed and self.on_removed is not None:
            self.on_removed(removed)
