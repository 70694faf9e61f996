"""The global prefix index: which location holds which KV block.

A location is a worker id ("prefill-0") or a cache-pool instance ("pool:<instance id>",
``services/conductor/pool_watch.py``; the pool's tiers are not told apart). Blocks
are named by their chained block hash (``common/block_hash.py``), so a hash names a whole
prefix, not just one block's tokens; the index still checks prefix order per location,
because a location may have evicted an early block and kept a later one.

Layout: one dict ``hash -> bitmask`` with one bit per location. Matching a chain of k
blocks is k dict look-ups and a few integer ops, whatever the number of locations.

Contract:

- ``stored`` and ``removed`` are idempotent: storing a held block or removing an absent
  one changes nothing.
- ``match`` answers, for each location holding the first block of the chain, how many
  leading blocks of the chain it holds; locations holding none are absent.
- ``match_group`` answers how many leading blocks of the chain are each held by at
  least one location of a group (names starting with a prefix): the cache pool's
  instances together serve a chain whose blocks placement spread over them.
- ``drop_location`` forgets everything a location held (a dead worker, a wiped tier)
  and frees its bit for reuse; it costs one pass over the index.
- ``held(location)`` is the number of blocks the location holds, kept as it changes.
"""

from __future__ import annotations

from collections.abc import Iterable


class PrefixIndex:
    def __init__(self) -> None:
        self._masks: dict[int, int] = {}
        self._bits: dict[str, int] = {}
        self._names: dict[int, str] = {}
        self._free_bits: list[int] = []
        self._held: dict[int, int] = {}  # bit -> blocks held

    def __len__(self) -> int:
        """Number of distinct blocks held by at least one location."""
        return len(self._masks)

    def locations(self) -> list[str]:
        return sorted(self._bits)

    def held(self, location: str) -> int:
        """Number of blocks ``location`` holds (0 for an unknown location)."""
        bit = self._bits.get(location)
        return 0 if bit is None else self._held[bit]

    def counts(self) -> dict[str, int]:
        """Blocks held per location."""
        return {name: self._held[bit] for name, bit in sorted(self._bits.items())}

    def _bit(self, location: str) -> int:
        bit = self._bits.get(location)
        if bit is None:
            if not isinstance(location, str) or not location:
                raise ValueError(f"location must be a non-empty str, got {location!r}")
            bit = self._free_bits.pop() if self._free_bits else 1 << len(self._bits)
            self._bits[location] = bit
            self._names[bit] = location
            self._held[bit] = 0
        return bit

    def stored(self, location: str, hashes: Iterable[int]) -> None:
        """``location`` now holds these blocks."""
        bit = self._bit(location)
        masks = self._masks
        added = 0
        for h in hashes:
            m = masks.get(h, 0)
            if not m & bit:
                masks[h] = m | bit
                added += 1
        self._held[bit] += added

    def removed(self, location: str, hashes: Iterable[int]) -> None:
        """``location`` no longer holds these blocks (evicted or freed)."""
        bit = self._bits.get(location)
        if bit is None:
            return
        masks = self._masks
        gone = 0
        for h in hashes:
            m = masks.get(h)
            if m is None or not m & bit:
                continue
            gone += 1
            m &= ~bit
            if m:
                masks[h] = m
            else:
                del masks[h]
        self._held[bit] -= gone

    def drop_location(self, location: str) -> int:
        """Forget ``location`` entirely; returns how many blocks it held."""
        bit = self._bits.pop(location, None)
        if bit is None:
            return 0
        del self._names[bit]
        del self._held[bit]
        dropped, empty = 0, []
        for h, m in self._masks.items():
            if m & bit:
                dropped += 1
                m &= ~bit
                if m:
                    self._masks[h] = m
                else:
                    empty.append(h)
        for h in empty:
            del self._masks[h]
        self._free_bits.append(bit)
        return dropped

    def apply(self, location: str, kind: str, hashes: Iterable[int]) -> None:
        """One KV event of ``location``: ``kind`` "stored", "removed" or "cleared" (it
        holds nothing: ``drop_location``); any other kind changes nothing."""
        if kind == "stored":
            self.stored(location, hashes)
        elif kind == "removed":
            self.removed(location, hashes)
        elif kind == "cleared":
            self.drop_location(location)

    def match(self, hashes: list[int]) -> dict[str, int]:
        """For each location, the number of leading blocks of ``hashes`` it holds."""
        if not hashes:
            return {}
        masks = self._masks
        alive = masks.get(hashes[0], 0)
        if not alive:
            return {}
        names = self._names
        result: dict[str, int] = {}
        for i in range(1, len(hashes)):
            m = masks.get(hashes[i], 0)
            gone = alive & ~m
            while gone:
                low = gone & -gone
                result[names[low]] = i
                gone ^= low
            alive &= m
            if not alive:
                return result
        n = len(hashes)
        while alive:
            low = alive & -alive
            result[names[low]] = n
            alive ^= low
        return result

    def match_group(self, hashes: list[int], prefix: str) -> int:
        """Number of leading blocks of ``hashes`` each held by at least one location
        whose name starts with ``prefix`` (not necessarily the same one)."""
        group = 0
        for name, bit in self._bits.items():
            if name.startswith(prefix):
                group |= bit
        if not group:
            return 0
        masks = self._masks
        n = 0
        for h in hashes:
            if not masks.get(h, 0) & group:
                break
            n += 1
        return n
