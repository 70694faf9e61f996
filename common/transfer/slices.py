"""Which KV heads of a transfer have landed, for a transfer sent as head slices.

A tensor-parallel prefill worker's ranks each send their KV heads' slice of every
layer on their own connection (``wire.py``, ``Chunk.heads``); the receiver's table
keeps one ``SliceLedger`` per such transfer, so that a slice is refused before it is
written when it overlaps one already landed or names another head count, and the
transfer settles only once every head of every (layer, block) it took slices for
is in. A mask per (layer, block): a few hundred small ints for a long prompt.
"""

from __future__ import annotations


class SliceLedger:
    """The heads landed per (layer, block) of one transfer; ``total`` heads in all."""

    def __init__(self, total: int) -> None:
        self.total = total
        self._full = (1 << total) - 1
        self._masks: dict[tuple[int, int], int] = {}

    def refuse(self, layer: int, block_ids: list[int], heads: tuple[int, int, int]) -> str | None:
        """Why the slice ``heads`` of ``layer``'s ``block_ids`` may not land; None if it may."""
        start, count, total = heads
        if total != self.total:
            return f"head slice of {total} heads in a transfer of {self.total}"
        if len(set(block_ids)) != len(block_ids):
            return f"head slice names a block twice: {block_ids[:8]}"
        mask = ((1 << count) - 1) << start
        masks = self._masks
        for b in block_ids:
            if masks.get((layer, b), 0) & mask:
                return (f"heads [{start}, {start + count}) of layer {layer} block {b} "
                        "sent twice")
        return None

    def land(self, layer: int, block_ids: list[int], heads: tuple[int, int, int]) -> None:
        start, count, _ = heads
        mask = ((1 << count) - 1) << start
        masks = self._masks
        for b in block_ids:
            masks[(layer, b)] = masks.get((layer, b), 0) | mask

    def missing(self) -> str | None:
        """What is not in yet (the first of it), or None when every head is."""
        for (layer, b), mask in self._masks.items():
            if mask != self._full:
                have = bin(mask).count("1")
                return (f"layer {layer} block {b} has {have} of its {self.total} heads")
        return None
