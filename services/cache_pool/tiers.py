"""The cache pool's two storage tiers: a DRAM arena (here) and an SSD directory
(``ssd_tier``, re-exported).

Both hold opaque byte blocks keyed by a 64-bit block hash, never exceed their byte
capacity, and ask an ``EvictionPolicy`` (given empty, owned by the tier from then on)
which block to drop when full. A block's bytes never change under its key (the key is
a hash of its content), so putting a key already held only counts as a use.
"""

from __future__ import annotations

import mmap

from common.pool.keys import Buffer, check_block
from services.cache_pool.block import Evicted, check_empty_policy
from services.cache_pool.eviction import EvictionPolicy
from services.cache_pool.ssd_tier import Recovery, SsdTier

__all__ = ["DramTier", "Evicted", "Recovery", "SsdTier"]


class DramTier:
    """A fixed arena: one anonymous memory map of ``capacity_bytes`` (pages are only
    backed once written, so a large arena costs nothing up front) cut into slots of
    ``block_bytes``; a block of up to ``block_bytes`` takes one slot::

        arena  [ slot 0 | slot 1 | ... | slot n-1 | unused tail < block_bytes ]
        free   [n-1, ..., 1, 0]   (popped from the end: slot 0 is used first)

    ``put`` evicts the policy's victims until a slot is free, and returns them so the
    caller can demote them. ``get`` returns a view into the arena, valid until the next
    ``put`` or ``remove`` on this tier (copy it to keep it). Raises before changing
    anything on a bad key, depth or block size.
    """

    def __init__(self, capacity_bytes: int, policy: EvictionPolicy, block_bytes: int) -> None:
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        if capacity_bytes < block_bytes:
            raise ValueError(f"capacity_bytes {capacity_bytes} holds no block of {block_bytes}")
        check_empty_policy(policy)
        self.capacity_bytes = capacity_bytes
        self.block_bytes = block_bytes
        self.policy = policy
        self.num_slots = capacity_bytes // block_bytes
        self.evictions = 0
        self._arena = mmap.mmap(-1, capacity_bytes)
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._slots: dict[int, tuple[int, int, int]] = {}  # key -> (slot, length, depth)
        self._used = 0

    def put(self, key: int, data: Buffer, depth: int = 0) -> list[Evicted]:
        data = check_block(key, data, depth)
        if len(data) > self.block_bytes:
            raise ValueError(f"block of {len(data)} bytes exceeds block_bytes {self.block_bytes}")
        if key in self._slots:
            self.policy.on_access(key)
            return []
        evicted = []
        while not self._free:
            victim = self.policy.victim()
            evicted.append(Evicted(victim, bytes(self._view(victim)), self._slots[victim][2]))
            self.remove(victim)
            self.evictions += 1
        slot = self._free.pop()
        start = slot * self.block_bytes
        self._arena[start:start + len(data)] = data
        self._slots[key] = (slot, len(data), depth)
        self._used += len(data)
        self.policy.on_insert(key, depth)
        return evicted

    def _view(self, key: int) -> memoryview:
        slot, length, _ = self._slots[key]
        start = slot * self.block_bytes
        return memoryview(self._arena)[start:start + length]

    def get(self, key: int) -> memoryview | None:
        """The block's bytes (a view into the arena) and a use, or None if absent."""
        if key not in self._slots:
            return None
        self.policy.on_access(key)
        return self._view(key)

    def contains(self, key: int) -> bool:
        return key in self._slots

    __contains__ = contains

    def depth(self, key: int) -> int:
        return self._slots[key][2]

    def remove(self, key: int) -> bool:
        """Drop ``key``; False if it was not held."""
        entry = self._slots.pop(key, None)
        if entry is None:
            return False
        self._free.append(entry[0])
        self._used -= entry[1]
        self.policy.on_remove(key)
        return True

    def keys(self) -> list[int]:
        return list(self._slots)

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._slots)
