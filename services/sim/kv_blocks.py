"""One simulated worker's paged KV cache with prefix caching, block for block as the
engine's ``BlockManager`` keeps it: the prefix cache is the worker's own KV blocks.

A request holds its blocks from admission to its end: full prompt blocks under their
hash once computed (shared by every request with that prefix), the rest (output,
blocks still being filled) plain. Freed hashed blocks stay cached at the tail of an LRU
queue, tail blocks of a request first, and are evicted only when an allocation needs
their room; the prefix index hears ``stored`` when a block gets its hash and
``removed`` when it is evicted, as the live worker's KV events say.
"""

from __future__ import annotations

from collections import OrderedDict

from services.conductor.prefix_index import PrefixIndex


class KVBlocks:
    def __init__(self, location: str, capacity: int, index: PrefixIndex) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0 blocks, got {capacity}")
        self.location, self.capacity, self.index = location, capacity, index
        self.refs: dict[int, int] = {}  # hashed blocks in use -> references
        self.lru: OrderedDict[int, None] = OrderedDict()  # hashed, free: evictable
        self.plain = 0  # blocks in use without a hash
        self.held: dict[int, tuple[list[int], int]] = {}  # rid -> (hashes held, plain)

    @property
    def used(self) -> int:
        return len(self.refs) + self.plain

    @property
    def free(self) -> int:
        """Blocks an allocation may take: plain free ones and cached free ones."""
        return self.capacity - self.used

    def prefix(self, hashes: list[int]) -> int:
        """Leading blocks of ``hashes`` held here, in use or cached."""
        n = 0
        while n < len(hashes) and (hashes[n] in self.refs or hashes[n] in self.lru):
            n += 1
        return n

    def fits(self, hashes: list[int], blocks: int) -> bool:
        hit = self.prefix(hashes)
        from_lru = sum(1 for h in hashes[:hit] if h in self.lru)
        return blocks - hit <= self.free - from_lru

    def admit(self, rid: int, hashes: list[int], blocks: int) -> int | None:
        """Take ``blocks`` blocks for request ``rid``, reusing its cached prefix; returns
        the prefix's length in blocks, or None (nothing taken) if they do not fit."""
        if rid in self.held:
            raise ValueError(f"request {rid} already holds blocks on {self.location}")
        if not self.fits(hashes, blocks):
            return None
        hit = self.prefix(hashes)
        for h in hashes[:hit]:
            self.lru.pop(h, None)
            self.refs[h] = self.refs.get(h, 0) + 1
        self.plain += blocks - hit
        self.held[rid] = (list(hashes[:hit]), blocks - hit)
        self._evict()
        return hit

    def commit(self, rid: int, hashes: list[int]) -> None:
        """The prompt's blocks are computed (or their KV landed): they take their hashes.
        A block whose hash another request cached meanwhile stays plain (a duplicate)."""
        held, plain = self.held[rid]
        stored = []
        for h in hashes[len(held):]:
            if plain == 0 or h in self.refs or h in self.lru:
                continue
            self.refs[h] = 1
            held.append(h)
            plain -= 1
            self.plain -= 1
            stored.append(h)
        self.held[rid] = (held, plain)
        if stored:
            self.index.stored(self.location, stored)

    def release(self, rid: int) -> None:
        """Free ``rid``'s blocks; hashed ones stay cached, its tail first in line."""
        held, plain = self.held.pop(rid)
        self.plain -= plain
        for h in reversed(held):
            self.refs[h] -= 1
            if self.refs[h] == 0:
                del self.refs[h]
                self.lru[h] = None

    def _evict(self) -> None:
        evicted = []
        while self.used + len(self.lru) > self.capacity:
            evicted.append(self.lru.popitem(last=False)[0])
        if evicted:
            self.index.removed(self.location, evicted)


class PoolTier:
    """The cache pool's DRAM tier as the simulator sees it: an LRU of blocks written back
    by prefill, a separate location (``pool:<name>``) in the prefix index."""

    def __init__(self, capacity: int, index: PrefixIndex, name: str = "pool:dram") -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0 blocks, got {capacity}")
        self.location, self.capacity, self.index = name, capacity, index
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def prefix(self, hashes: list[int]) -> int:
        n = 0
        while n < len(hashes) and hashes[n] in self.blocks:
            n += 1
        return n

    def insert(self, hashes: list[int]) -> None:
        new = [h for h in hashes if h not in self.blocks]
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        evicted = [self.blocks.popitem(last=False)[0]
                   for _ in range(len(self.blocks) - self.capacity)]
        self.index.stored(self.location, new)
        self.index.removed(self.location, evicted)
