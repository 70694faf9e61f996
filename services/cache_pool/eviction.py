"""Eviction policies: pure objects over block keys, no I/O, no bytes.

A tier tells its policy what happened (``on_insert``, ``on_access``, ``on_remove``) and
asks it which key to drop next (``victim``). The policy never removes a key by itself:
the caller evicts ``victim()`` and then reports ``on_remove`` for it, so the policy and
the tier cannot disagree about what is held.

Two policies:

* ``LRUPolicy``: exact least-recently-used; insert and access both count as a use.
* ``ReuseAwarePolicy``: evicts the block with the lowest predicted chance of reuse,
  from its recency, its decayed hit count and its depth in the prefix chain (see its
  docstring for the model and why; docs/cache_pool.md for the measurement).
"""

from __future__ import annotations

import heapq
import itertools
import math
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass


class EmptyPolicyError(LookupError):
    """``victim`` was asked of a policy that tracks no key."""


class EvictionPolicy(ABC):
    """Orders the keys a tier holds by how much it would lose by dropping each.

    Contract (every subclass):
    - ``on_insert(key, depth)`` starts tracking ``key``; ``depth`` is the block's index in
      its prefix chain (0 = first block). Inserting a tracked key raises ValueError.
    - ``on_access(key)`` records a use; ``on_remove(key)`` stops tracking. Both raise
      KeyError for a key that is not tracked, leaving the policy unchanged.
    - ``victim()`` returns the key to evict next without removing it, and raises
      ``EmptyPolicyError`` when nothing is tracked. Two calls with no event in between
      return the same key.
    - ``len(policy)`` is the number of tracked keys; ``key in policy`` tests membership.
    - Every operation costs O(log n) amortized or better.
    """

    @abstractmethod
    def on_insert(self, key: Hashable, depth: int) -> None: ...

    @abstractmethod
    def on_access(self, key: Hashable) -> None: ...

    @abstractmethod
    def on_remove(self, key: Hashable) -> None: ...

    @abstractmethod
    def victim(self) -> Hashable: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...


def _check_depth(depth: int) -> None:
    if depth < 0:
        raise ValueError(f"depth must be >= 0, got {depth}")


class LRUPolicy(EvictionPolicy):
    """Exact LRU: the victim is the key whose last insert or access is oldest. O(1)."""

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()  # oldest first

    def on_insert(self, key, depth):
        _check_depth(depth)
        if key in self._order:
            raise ValueError(f"key {key!r} is already tracked")
        self._order[key] = None

    def on_access(self, key):
        self._order.move_to_end(key)  # KeyError if untracked

    def on_remove(self, key):
        del self._order[key]

    def victim(self):
        if not self._order:
            raise EmptyPolicyError("no key to evict")
        return next(iter(self._order))

    def __len__(self):
        return len(self._order)

    def __contains__(self, key):
        return key in self._order


@dataclass(frozen=True, slots=True)
class ReuseParams:
    """Parameters of ``ReuseAwarePolicy``, in tokens, so the policy behaves the same for
    any block size. They are written in ticks of ``unit_tokens`` tokens: the policy's
    clock advances by ``block_tokens / unit_tokens`` ticks per insert or access of one
    block, and a block's depth counts ``depth * block_tokens / unit_tokens`` units. At the
    default unit (512 tokens, the block of the Mooncake traces the defaults were tuned on)
    a 16-token paging block advances the clock by 1/32 tick: replaying the same tokens in
    32x as many blocks gives the same order.

    half_life: after this many ticks a past use counts half as much. It is the workload's
        reuse time scale, not the cache's size: in the Mooncake conversation trace the
        median time from a block's first use to its second is ~12k ticks (~6M tokens).
    depth_cost: ticks of age charged per doubling of ``1 + depth in units``; a block 31
        units deep is treated as ``5 * depth_cost`` ticks older than the chain's first.
    history_ratio: how many evicted keys' use history is remembered, as a multiple of the
        keys tracked (at least ``history_floor`` units' worth of keys), so a block that
        comes back after eviction keeps its frequency.
    unit_tokens: tokens per tick and per depth unit.
    """

    half_life: float = 16384.0
    depth_cost: float = 512.0
    history_ratio: float = 4.0
    history_floor: int = 1024
    unit_tokens: int = 512

    def __post_init__(self) -> None:
        for name in ("half_life", "depth_cost", "history_ratio"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value}")
        if self.half_life == 0:
            raise ValueError("half_life must be > 0")
        if self.history_floor < 0:
            raise ValueError(f"history_floor must be >= 0, got {self.history_floor}")
        if self.unit_tokens <= 0:
            raise ValueError(f"unit_tokens must be > 0, got {self.unit_tokens}")


class ReuseAwarePolicy(EvictionPolicy):
    """Evicts the block least likely to be reused: decayed frequency, recency, depth.

    Model. Each use of a block adds 1 to its reuse score, and the score halves every
    ``half_life`` ticks (the CRF of LRFU):  ``C <- 1 + C * 2**(-(now - last) / half_life)``.
    A deep block is worth less than a shallow one (every continuation of a prefix shares
    the shallow blocks; a deep one serves only its own chain), so its age is inflated by
    ``depth_cost * log2(1 + depth)`` ticks. The policy evicts the lowest
    ``log2(C(now)) - depth_cost * log2(1 + depth) / half_life``.

    Why a heap with a static key. With exponential decay every block's score falls by the
    same factor per tick, so the *order* of two blocks never changes while neither is
    used. Multiplying by ``half_life`` and adding ``now`` gives a time-free key::

        key = half_life * log2(C at last use) + last_use_tick - depth_cost * log2(1 + depth units)

    computed once per insert or access and pushed on a min-heap; older entries of the same
    block go stale (lazy invalidation: each entry carries a sequence number, and ``victim``
    drops heap tops that are not the block's current entry). The heap is rebuilt when
    stale entries outnumber live ones, so every operation is O(log n) amortized. Ties go
    to the entry pushed first.

    History. ``on_remove`` keeps the block's score as a ghost (bounded by
    ``history_ratio`` x tracked keys, oldest dropped first); if the block is inserted
    again its score resumes from the decayed ghost. In the conversation trace a block
    used twice is used again 42% of the time against 24% for a fresh block, often after
    a small cache has dropped it; without the history the policy loses a point of hit
    ratio at 5% capacity and four at 1%.

    Limits. With ``half_life`` -> 0 this is LRU over ages inflated by depth; with
    ``half_life`` -> inf it is LFU. Measured against LRU in docs/cache_pool.md.

    Block size. ``block_tokens`` (default: ``params.unit_tokens``) is the size of the
    blocks this policy orders; the pool passes the engine's. Ticks and depths are scaled
    by it (see ``ReuseParams``), so a 16-token cache and a 512-token cache holding the
    same tokens evict the same tokens in the same order, up to ties inside one unit.

    Example (default parameters, 512-token blocks): insert A at depth 0 and access it
    three times, then insert B at depth 10. LRU would evict A, the least recent; this
    policy evicts B:
    A's key is ~2 * half_life, B's is about ``5 - 3.46 * depth_cost``.
    """

    def __init__(self, params: ReuseParams | None = None, block_tokens: int | None = None
                 ) -> None:
        self.params = params or ReuseParams()
        self.block_tokens = self.params.unit_tokens if block_tokens is None else block_tokens
        if self.block_tokens <= 0:
            raise ValueError(f"block_tokens must be > 0, got {self.block_tokens}")
        self._tick = self.block_tokens / self.params.unit_tokens  # ticks per block operation
        self._history_floor = math.ceil(self.params.history_floor / self._tick)
        self._clock = 0.0
        self._seq = itertools.count()
        # key -> (last use tick, score at last use, depth, seq of its live heap entry)
        self._live: dict[Hashable, tuple[float, float, int, int]] = {}
        self._heap: list[tuple[float, int, Hashable]] = []
        self._ghosts: OrderedDict[Hashable, tuple[float, float]] = OrderedDict()

    def _depth_ticks(self, depth: int) -> float:
        return self.params.depth_cost * math.log2(1 + depth * self._tick)

    def _decayed(self, score: float, since: float) -> float:
        return score * 2.0 ** (-(self._clock - since) / self.params.half_life)

    def _push(self, key: Hashable, score: float, depth: int) -> None:
        p = self.params
        seq = next(self._seq)
        self._live[key] = (self._clock, score, depth, seq)
        prio = p.half_life * math.log2(score) + self._clock - self._depth_ticks(depth)
        heapq.heappush(self._heap, (prio, seq, key))
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = [e for e in self._heap if self._is_live(e)]
            heapq.heapify(self._heap)

    def _is_live(self, entry: tuple[float, int, Hashable]) -> bool:
        state = self._live.get(entry[2])
        return state is not None and state[3] == entry[1]

    def on_insert(self, key, depth):
        _check_depth(depth)
        if key in self._live:
            raise ValueError(f"key {key!r} is already tracked")
        self._clock += self._tick
        ghost = self._ghosts.pop(key, None)
        score = 1.0 if ghost is None else 1.0 + self._decayed(ghost[1], ghost[0])
        self._push(key, score, depth)

    def on_access(self, key):
        last, score, depth, _ = self._live[key]  # KeyError if untracked
        self._clock += self._tick
        self._push(key, 1.0 + self._decayed(score, last), depth)

    def on_remove(self, key):
        last, score, _, _ = self._live.pop(key)  # KeyError if untracked
        self._ghosts[key] = (last, score)
        limit = max(self._history_floor, int(self.params.history_ratio * len(self._live)))
        while len(self._ghosts) > limit:
            self._ghosts.popitem(last=False)

    def victim(self):
        while self._heap:
            if self._is_live(self._heap[0]):
                return self._heap[0][2]
            heapq.heappop(self._heap)
        raise EmptyPolicyError("no key to evict")

    def score(self, key: Hashable) -> float:
        """The block's current eviction priority in log2 units (lower goes first)."""
        last, score, depth, _ = self._live[key]
        depth_bits = self._depth_ticks(depth) / self.params.half_life
        return math.log2(self._decayed(score, last)) - depth_bits

    def __len__(self):
        return len(self._live)

    def __contains__(self, key):
        return key in self._live
