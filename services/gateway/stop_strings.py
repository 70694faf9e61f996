"""Stop strings over streamed text: cut at the first match, never emit half of one."""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Feeds on text pieces and says what may be shown and whether a stop string hit.

    Contract: the pieces returned by ``feed`` and ``flush``, concatenated, equal the fed
    text cut right before the first occurrence of any stop string (right after it with
    ``include_stop``), where "first" is the earliest start, the earlier-listed string on
    a tie. Text that could still become the start of a stop string is held back until
    the next piece decides it, so a stop string split across pieces is never partly
    shown. After a hit, the matcher must not be fed again.
    """

    def __init__(self, stops: Sequence[str], include_stop: bool = False) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = list(stops)
        self._include = include_stop
        self._pending = ""

    def feed(self, text: str, check: bool = True) -> tuple[str, bool]:
        """Add ``text``; return (text safe to show now, whether a stop string hit).

        With ``check=False`` (e.g. before ``min_tokens`` is reached) nothing is matched
        and everything held is released.
        """
        pending = self._pending + text
        if not check or not self._stops:
            self._pending = ""
            return pending, False
        hit: tuple[int, str] | None = None
        for stop in self._stops:
            index = pending.find(stop)
            if index >= 0 and (hit is None or index < hit[0]):
                hit = (index, stop)
        if hit is not None:
            self._pending = ""
            index, stop = hit
            return pending[:index + (len(stop) if self._include else 0)], True
        held = self._partial_suffix(pending)
        self._pending = pending[len(pending) - held:]
        return pending[:len(pending) - held], False

    def flush(self) -> str:
        """Release held-back text (the stream ended without completing a stop string)."""
        pending, self._pending = self._pending, ""
        return pending

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop."""
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
