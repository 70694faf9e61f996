"""A ``LandingSink``'s two steps for a whole BATCH at once (``base.py``).

A receiver that lands a batch's bytes itself (shm: copied out of the segment; tcp: read
out of the socket) asks the sink where all of the batch's chunks go, and tells it once
they were verified. One call each per batch: a request's 30 layers cost two sink calls,
not sixty (at 1 MiB those calls were the largest single piece of Python per request).

A sink with ``landing_many`` / ``landed_many`` is called with the batch's columns as
they are; one with only the per-chunk ``landing`` / ``landed`` is called once a chunk
through ``PerChunk``, with the same outcome.
"""

from __future__ import annotations

from collections.abc import Callable


class Landings:
    """The two batch steps of one sink: ``where(request_id, layers, block_ids, sizes)``
    gives the writable buffers that, back to back, hold the chunks' bytes in payload
    order, or None where the sink declines (nothing written then; the sink call takes
    each chunk); ``landed(request_id, layers, block_ids, sizes)`` says all of them were
    verified. Either raising fails the transfer."""

    __slots__ = ("where", "landed")

    def __init__(self, where: Callable, landed: Callable) -> None:
        self.where, self.landed = where, landed

    @classmethod
    def of(cls, sink) -> Landings | None:
        """The batch steps of ``sink``, or None for a sink that names no destinations."""
        where, landed = getattr(sink, "landing_many", None), getattr(sink, "landed_many", None)
        if where is not None and landed is not None:
            return cls(where, landed)
        one, told = getattr(sink, "landing", None), getattr(sink, "landed", None)
        if one is None or told is None:
            return None
        per_chunk = PerChunk(one, told)
        return cls(per_chunk.where, per_chunk.landed)


class PerChunk:
    """The batch steps of a sink that has only the per-chunk ``landing`` / ``landed``."""

    __slots__ = ("_one", "_told")

    def __init__(self, one: Callable, told: Callable) -> None:
        self._one, self._told = one, told

    def where(self, request_id: str, layers: list[int], block_ids: list[list[int]],
              sizes: list[int]) -> list | None:
        destinations: list = []
        for layer, blocks, size in zip(layers, block_ids, sizes, strict=True):
            views = self._one(request_id, layer, blocks, size)
            if views is None:
                return None
            destinations.extend(views)
        return destinations

    def landed(self, request_id: str, layers: list[int], block_ids: list[list[int]],
               sizes: list[int]) -> None:
        for layer, blocks, size in zip(layers, block_ids, sizes, strict=True):
            self._told(request_id, layer, blocks, size)
