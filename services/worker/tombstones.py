"""Request ids aborted before (or while) their request was admitted.

An Abort and the Generate it cancels are handled concurrently: the Abort may run while
the Generate still awaits the pool, or even before the Generate arrives. Either way the
engine does not know the request yet, so aborting it there does nothing, and the request
would then run to its last token for nobody. A tombstone remembers the id for a while;
admission checks it after every await and gives up if it is there.
"""

from __future__ import annotations

import collections
import time


class Tombstones:
    """A bounded set of recently aborted request ids, each kept for ``ttl_s``."""

    def __init__(self, ttl_s: float = 60.0, max_size: int = 8192) -> None:
        self.ttl_s = ttl_s
        self.max_size = max_size
        self._ids: collections.OrderedDict[str, float] = collections.OrderedDict()

    def add(self, rid: str) -> None:
        self._ids.pop(rid, None)
        self._ids[rid] = time.monotonic() + self.ttl_s
        while len(self._ids) > self.max_size:
            self._ids.popitem(last=False)

    def __contains__(self, rid: str) -> bool:
        self._expire()
        return rid in self._ids

    def discard(self, rid: str) -> None:
        self._ids.pop(rid, None)

    def __len__(self) -> int:
        self._expire()
        return len(self._ids)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._ids:
            rid, until = next(iter(self._ids.items()))
            if until > now:
                return
            del self._ids[rid]
