"""The shm sender's ring of segments, per receiver connection (``shm_sender.py``; the
protocol and segment lifetime: ``shm.py``)."""

from __future__ import annotations

import asyncio
import collections

from common.transfer import control, wire
from common.transfer.base import TransferError
from common.transfer.connections import InFlight
from common.transfer.shm_segment import Segment, new_prefix, segment_name, unlink_prefix

GROW = 1 << 20  # segments are made in whole MiB
PLACE = 4096  # chunks sharing a segment start on page boundaries


class Ring:
    """One connection's slots. ``error`` is set once the connection is gone.

    One slot is open: chunks are placed in its segment one after another while they fit.
    A chunk that does not fit opens a free slot, the most recently emptied first (so only
    as many segments grow large as large chunks are in flight together), and the slot it
    leaves is freed once its last chunk is answered. An open slot that empties starts
    over at its beginning; one too small for the next chunk, and empty, is grown.
    """

    def __init__(self, directory: str, slots: int, min_bytes: int, budget: int) -> None:
        self.directory, self.prefix, self.min_bytes = directory, new_prefix(), min_bytes
        self.segments: list[Segment | None] = [None] * slots
        self.generations = [0] * slots
        self.fill = [0] * slots  # where the slot's next chunk would start
        # The chunks placed in each slot and not answered yet, in placing order (the
        # order of their verdicts).
        self.waiting = [collections.deque[InFlight]() for _ in range(slots)]
        self.free = list(range(slots - 1, -1, -1))
        self.open: int | None = None
        self.budget, self.in_flight, self.chunks = budget, 0, 0
        self.changed = asyncio.Event()
        self.error: str | None = None
        self.created = 0

    def _room(self, nbytes: int) -> bool:
        """Whether a chunk of ``nbytes`` can be placed now."""
        if self.in_flight and self.in_flight + nbytes > self.budget:
            return False
        slot = self.open
        if slot is None or not self.waiting[slot]:
            return slot is not None or bool(self.free)
        segment = self.segments[slot]
        return bool(self.free) or segment.size - self.fill[slot] >= nbytes

    async def place(self, attempt: InFlight, before_waiting) -> tuple[int, Segment, int]:
        """``(slot, segment, offset)`` where ``attempt``'s payload goes, once it fits in
        the budget (or nothing is in flight) and in a slot; ``before_waiting()`` is
        called before waiting for that. ``attempt`` then waits for its verdict here.

        Raises TransferError once the connection is gone, OSError if a segment cannot
        be made.
        """
        nbytes = attempt.nbytes
        if self.error is None and not self._room(nbytes):
            before_waiting()
            while self.error is None and not self._room(nbytes):
                self.changed.clear()
                await self.changed.wait()
        if self.error is not None:
            raise TransferError(self.error)
        slot = self.open
        if slot is not None and self.waiting[slot]:
            segment = self.segments[slot]
            if segment.size - self.fill[slot] < nbytes:
                slot = self.free[-1]
        elif slot is None:
            slot = self.free[-1]
        segment = self._segment(slot, self.fill[slot] + nbytes)
        if slot != self.open:
            self.free.pop()
            self.open = slot
        offset = self.fill[slot]
        self.fill[slot] = -(-(offset + nbytes) // PLACE) * PLACE
        self.waiting[slot].append(attempt)
        self.in_flight += nbytes
        self.chunks += 1
        return slot, segment, offset

    def _segment(self, slot: int, nbytes: int) -> Segment:
        """The slot's segment, replaced by a larger one (it is empty then) if ``nbytes``
        do not fit."""
        segment = self.segments[slot]
        if segment is not None and segment.size >= nbytes:
            return segment
        if segment is not None:
            segment.unlink()  # the receiver removed it already unless it never mapped it
            segment.close()
            self.segments[slot] = None
        self.generations[slot] += 1
        size = max(self.min_bytes, -(-nbytes // GROW) * GROW)
        name = segment_name(self.prefix, slot, self.generations[slot])
        segment = self.segments[slot] = Segment.create(self.directory, name, size)
        self.created += 1
        return segment

    def release(self, slot: int, verdict: wire.Verdict) -> None:
        """Hand the oldest chunk waiting in ``slot`` its ``verdict``; free the slot once
        none waits there."""
        if slot >= len(self.segments) or not self.waiting[slot]:
            raise control.ControlError(f"verdict for slot {slot}, which has no chunk in flight")
        attempt = self.waiting[slot].popleft()
        self.in_flight -= attempt.nbytes
        self.chunks -= 1
        if not self.waiting[slot]:
            self.fill[slot] = 0
            if slot != self.open:
                self.free.append(slot)
        self.changed.set()
        attempt.answered(verdict)

    async def drained(self) -> None:
        """Return once every chunk is answered (or the connection is gone)."""
        while self.error is None and self.chunks:
            self.changed.clear()
            await self.changed.wait()

    def destroy(self, reason: str) -> None:
        self.error = self.error or reason
        self.changed.set()
        for waiting in self.waiting:
            while waiting:
                waiting.popleft().lost(self.error)
        for segment in self.segments:
            if segment is not None:
                segment.close()
        self.segments = [None] * len(self.segments)
        unlink_prefix(self.directory, self.prefix)
