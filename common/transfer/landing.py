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

import xxhash


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


def scatterer(table_lands: bool):
    """What a receiver hands the table as ``scatter`` (copy a payload into the sink's
    destinations, return the digest of what landed): the copy-and-checksum kernel's
    ``scatter_all`` where it is built and the sink names destinations, else None (the
    receiver hashes where the bytes lie and the sink call copies). A payload too short
    for the kernel (``SHORT`` bytes) is copied and hashed here."""
    if not table_lands:
        return None
    from kernels import cpu_copysum  # imports no torch itself

    mod = cpu_copysum.kernel()
    return None if mod is None else _Scatter(mod.scatter_all, cpu_copysum.SHORT)


class _Scatter:
    __slots__ = ("_kernel", "_short")

    def __init__(self, kernel: Callable, short: int) -> None:
        self._kernel, self._short = kernel, short

    def __call__(self, payload: memoryview, destinations: list) -> int:
        if payload.nbytes > self._short:
            return self._kernel(payload, destinations)
        at = 0
        for view in destinations:
            view[:] = payload[at : at + len(view)]  # ValueError where a size is off
            at += len(view)
        if at != payload.nbytes:
            raise ValueError(f"scatter: a source of {payload.nbytes} bytes for "
                             f"destinations of {at}")
        return xxhash.xxh3_64_intdigest(payload)


class Filling:
    """A payload read straight into a sink's destinations (the tcp receiver): ``buffer``
    is where the next bytes go; ``took(n)`` hashes the ``n`` bytes just written there
    while they are in cache and moves on; ``left`` bytes are still to come, ``digest``
    the XXH3-64 of those that came. ValueError where the destinations are read-only,
    not contiguous, or do not hold exactly ``nbytes``."""

    __slots__ = ("_views", "_filled", "_hasher", "left")

    def __init__(self, destinations: list, nbytes: int) -> None:
        views = [v for v in map(_writable, reversed(destinations)) if len(v)]  # last first
        held = sum(map(len, views))
        if held != nbytes:
            raise ValueError(f"destinations of {held} bytes for a batch of {nbytes}")
        self._views, self._filled, self.left = views, 0, nbytes
        self._hasher = xxhash.xxh3_64()  # seed 0, as wire.checksum

    @property
    def buffer(self) -> memoryview:
        return self._views[-1][self._filled :]

    def took(self, nbytes: int) -> None:
        view, filled = self._views[-1], self._filled
        self._filled = filled + nbytes
        self._hasher.update(view[filled : self._filled])
        self.left -= nbytes
        if self._filled == len(view):
            self._views.pop()
            self._filled = 0

    def fill(self, source: memoryview) -> None:
        """Copy ``source`` (fewer than ``left`` bytes) in, as if read there."""
        while source:
            buffer = self.buffer
            n = min(len(buffer), len(source))
            buffer[:n] = source[:n]
            self.took(n)
            source = source[n:]

    def digest(self) -> int:
        return self._hasher.intdigest()


def _writable(buffer) -> memoryview:
    view = memoryview(buffer)
    if view.readonly or not view.c_contiguous:
        raise ValueError("a destination that is read-only or not contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view
