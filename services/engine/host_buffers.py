"""Host memory for KV leaving a device: a small pool of reusable (pinned on CUDA)
buffers, and an export that copies on a side stream while compute goes on.

Pinning memory is a system call that costs more than copying a layer's KV, so export
buffers are kept and reused, keyed by their exact size (the sizes a worker exports
repeat: a layer of N blocks). A buffer goes back to the pool only when nothing holds its
bytes any more: the memoryview handed out keeps a numpy array alive, and that array's
finalizer returns the buffer. So a reader can hold an export as long as it likes; the
pool only allocates more meanwhile.

Imports go the other way: bytes are staged in a pooled pinned buffer, copied to the
device and scattered into their blocks on the side stream, and the compute stream waits
for that on the device (an event), never the host thread. A staging buffer goes back to
the pool only once its copy is done (:meth:`HostBufferPool.give_back_when`).

On the CPU nothing here is used: an export is a view of the gathered tensor (zero copy).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch


class PoolStats(NamedTuple):
    allocated: int  # buffers ever made
    reused: int  # takes served by an idle buffer
    idle: int  # buffers waiting in the pool now
    idle_bytes: int


class HostBufferPool:
    """Reusable uint8 host buffers; pinned when ``pin`` (only ever on CUDA hosts).

    At most ``max_idle_per_size`` idle buffers of one size and ``max_idle_bytes`` in
    all are kept; a buffer returned beyond that is freed. ``close`` frees the idle ones
    and makes buffers returned later be freed too. Thread-safe: buffers come back on
    whatever thread drops the last view.
    """

    def __init__(self, pin: bool, max_idle_per_size: int = 4,
                 max_idle_bytes: int = 1 << 30) -> None:
        self.pin = pin
        self.max_idle_per_size, self.max_idle_bytes = max_idle_per_size, max_idle_bytes
        self._idle: dict[int, list[torch.Tensor]] = {}
        self._idle_bytes = 0
        self._allocated = self._reused = 0
        self._closed = False
        self._lock = threading.Lock()
        self._in_use: list[tuple[torch.Tensor, Any]] = []  # (buffer, event it waits for)

    def take(self, nbytes: int) -> torch.Tensor:
        """A ``[nbytes]`` uint8 buffer, idle or new; return it with :meth:`give_back`
        or hand it out with :meth:`view`."""
        self._reap()
        with self._lock:
            idle = self._idle.get(nbytes)
            if idle:
                self._reused += 1
                self._idle_bytes -= nbytes
                return idle.pop()
            self._allocated += 1
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def give_back(self, buf: torch.Tensor) -> None:
        nbytes = buf.numel()
        with self._lock:
            idle = self._idle.setdefault(nbytes, [])
            if (self._closed or len(idle) >= self.max_idle_per_size
                    or self._idle_bytes + nbytes > self.max_idle_bytes):
                return  # dropped: torch frees it
            idle.append(buf)
            self._idle_bytes += nbytes

    def give_back_when(self, buf: torch.Tensor, done: Any) -> None:
        """Return ``buf`` once event ``done`` has happened (a copy still reads it)."""
        with self._lock:
            self._in_use.append((buf, done))

    def _reap(self) -> None:
        with self._lock:
            finished, waiting = [], []
            for buf, done in self._in_use:
                (finished if done.query() else waiting).append((buf, done))
            self._in_use = waiting
        for buf, _ in finished:
            self.give_back(buf)

    def view(self, buf: torch.Tensor) -> memoryview:
        """``buf``'s bytes; ``buf`` returns to the pool once every view of them is gone."""
        arr = buf.numpy()
        weakref.finalize(arr, self.give_back, buf)
        return memoryview(arr).cast("B")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._in_use.clear()  # torch's allocator keeps each until its copy is done
            self._idle.clear()
            self._idle_bytes = 0

    @property
    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(self._allocated, self._reused,
                             sum(len(v) for v in self._idle.values()), self._idle_bytes)


class PendingBytes:
    """An export whose bytes may still be on their way: :meth:`wait` returns them (and
    blocks only this thread, only until the side stream's copy is done)."""

    def __init__(self, buf: Any, done: Any = None,
                 to_view: Callable[[Any], memoryview] | None = None,
                 keep: Any = None) -> None:
        self._buf, self._done, self._to_view = buf, done, to_view
        # What the copy still reads (the packed device tensor): held until it is done.
        self._keep = keep
        self._view: memoryview | None = None

    @classmethod
    def ready_now(cls, view: memoryview) -> PendingBytes:
        pending = cls(None)
        pending._view = view
        return pending

    def ready(self) -> bool:
        return self._view is not None or self._done is None or self._done.query()

    def wait(self) -> memoryview:
        if self._view is None:
            if self._done is not None:
                self._done.synchronize()
            self._view = self._to_view(self._buf)
            self._buf = self._done = self._keep = None
        return self._view


class SideStream:
    """Copies between host and device on a stream of their own.

    ``run(work)`` records an event on the current (compute) stream, makes the side
    stream wait for it (so the copy reads what the compute stream wrote so far), runs
    ``work()`` under the side stream and records ``done`` there. The compute stream
    never waits: the next step's kernels overlap the copy. ``streams`` is
    ``torch.cuda`` (a stand-in in tests).

    ``run_joined(work)`` is the same for work the compute stream must see (an import
    writing blocks): after ``done`` the compute stream is made to wait for it, on the
    device; this thread goes on at once.
    """

    def __init__(self, device: torch.device, streams: Any = None) -> None:
        self.streams = streams if streams is not None else torch.cuda
        self.stream = self.streams.Stream(device=device)

    def run(self, work: Callable[[], Any]) -> tuple[Any, Any]:
        """``(work's result, done event)``; the result is complete once ``done`` is."""
        written = self.streams.Event()
        written.record(self.streams.current_stream(self.stream.device))
        with self.streams.stream(self.stream):
            self.stream.wait_event(written)
            result = work()
            done = self.streams.Event()
            done.record(self.stream)
        return result, done

    def run_joined(self, work: Callable[[], Any]) -> Any:
        """:meth:`run`, then the compute stream waits (on the device) for ``done``;
        returns ``done``."""
        compute = self.streams.current_stream(self.stream.device)
        _, done = self.run(work)
        compute.wait_event(done)
        return done
