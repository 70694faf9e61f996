"""The global prefix index: which location holds which KV block.

A location is a worker id ("prefill-0") or a pool tier ("pool:dram", "pool:ssd"). Blocks
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
- ``drop_location`` forgets everything a location held (a dead worker, a wiped tier)
  and frees its bit for reuse; it costs one pass over the index.
"""

from __future__ import annotations

from collections.abc import Iterable


class PrefixIndex:
    def __init__(self) -> None:
        self._masks: dict[int, int] = {}
        self._bits: dict[str, int] = {}
        self._names: dict[int, str] = {}
        self._free_bits: list[int] = []

    def __len__(self) -> int:
        """Number of distinct blocks held by at least one location."""
        return len(self._masks)

    def locations(self) -> list[str]:
        return sorted(self._bits)

    def _bit(self, location: str) -> int:
        bit = self._bits.get(location)
        if bit is None:
            if not isinstance(location, str) or not location:
                raise ValueError(f"location must be a non-empty str, got {location!r}")
            bit = self._free_bits.pop() if self._free_bits else 1 << len(self._bits)
            self._bits[location] = bit
            self._names[bit] = location
        return bit

    def stored(self, location: str, hashes: Iterable[int]) -> None:
        """``location`` now holds these blocks."""
        bit = self._bit(location)
        masks = self._masks
        for h in hashes:
            masks[h] = masks.get(h, 0) | bit

    def removed(self, location: str, hashes: Iterable[int]) -> None:
        """``location`` no longer holds these blocks (evicted or freed)."""
        bit = self._bits.get(location)
        if bit is None:
            return
        masks = self._masks
        for h in hashes:
            m = masks.get(h)
            if m is None or not m & bit:
                continue
            m &= ~bit
            if m:
                masks[h] = m
            else:
                del masks[h]

    def drop_location(self, location: str) -> int:
        """Forget ``location`` entirely; returns how many blocks it held."""
        bit = self._bits.pop(location, None)
        if bit is None:
            return 0
        del self._names[bit]
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
