"""Reusable memory for the blocks a pool transfer brings in (a client's gets, the
pool's puts) or sends out (the pool's gets, copied from its DRAM tier).

A fetched prefix is tens of megabytes. Copied into new ``bytes`` per block, most of a
get's time went to the kernel faulting in and zeroing fresh pages (about 60 of 85 ms
for 115 blocks of 720 KiB over shm), not to the copy itself. ``LandingArenas`` keeps a
few anonymous maps whose pages stay touched, and lands each call's blocks in one of
them; a second get into a warm arena is a plain ``memcpy``.

The blocks handed out are views of an arena, and an arena is reused only when no view
of it is left: ``mmap.resize`` refuses while a buffer is exported, which is exactly the
question, so a caller may hold a get's blocks as long as it likes (the next get then
takes or makes another arena). Arenas beyond ``keep_bytes`` in all are let go, and a
call larger than that gets an arena of its own that is never kept.
"""

from __future__ import annotations

import mmap

PAGE = mmap.PAGESIZE


class LandingArenas:
    """Arenas for one receiver's event loop (not thread-safe)."""

    def __init__(self, keep_bytes: int = 256 << 20) -> None:
        if keep_bytes < 0:
            raise ValueError(f"keep_bytes must be >= 0, got {keep_bytes}")
        self.keep_bytes = keep_bytes
        self._arenas: list[mmap.mmap] = []  # most recently taken last
        self.made = self.reused = 0

    def take(self, nbytes: int) -> memoryview:
        """``nbytes`` of writable memory, in an idle arena when one is large enough
        (already faulted in), else in a new one. Raises MemoryError when none can be
        mapped."""
        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        fits = [a for a in self._arenas if len(a) >= nbytes and _idle(a)]
        if fits:
            arena = min(fits, key=len)
            self._arenas.remove(arena)
            self.reused += 1
        else:
            try:
                arena = mmap.mmap(-1, -(-nbytes // PAGE) * PAGE)
            except (OSError, OverflowError) as exc:
                raise MemoryError(f"cannot map {nbytes} bytes to land blocks in: "
                                  f"{exc}") from None
            self.made += 1
        view = memoryview(arena)[:nbytes]  # exported from here on: not idle
        self._arenas.append(arena)
        self._trim()
        return view

    def _trim(self) -> None:
        """Let go of the oldest arenas until those kept fit ``keep_bytes``; the newest
        (just taken) too when it alone is larger. An arena still viewed is only
        forgotten: its views keep it mapped until they go."""
        total = self.kept_bytes
        while self._arenas and total > self.keep_bytes:
            arena = self._arenas.pop(0)
            total -= len(arena)
            if _idle(arena):
                arena.close()

    @property
    def kept_bytes(self) -> int:
        return sum(map(len, self._arenas))

    def close(self) -> None:
        """Unmap the idle arenas and forget the rest."""
        for arena in self._arenas:
            if _idle(arena):
                arena.close()
        self._arenas.clear()


class Packer:
    """A ``copy`` for blocks that go out: each buffer copied after the one before into
    ``nbytes`` taken from ``arenas`` at the first call (none taken if never called); a
    buffer that no longer fits becomes a ``bytes`` of its own."""

    def __init__(self, arenas: LandingArenas, nbytes: int) -> None:
        self._arenas, self._nbytes = arenas, nbytes
        self._view: memoryview | None = None
        self._pos = 0

    def __call__(self, data: memoryview) -> memoryview | bytes:
        n = data.nbytes
        if self._view is None and self._nbytes > 0:
            self._view = self._arenas.take(self._nbytes)
        if self._view is None or self._pos + n > len(self._view):
            return bytes(data)
        out = self._view[self._pos:self._pos + n]
        out[:] = data
        self._pos += n
        return out


def _idle(arena: mmap.mmap) -> bool:
    """No buffer of ``arena`` is exported (no view of its bytes is alive)."""
    try:
        arena.resize(len(arena))
    except BufferError:
        return False
    return True
