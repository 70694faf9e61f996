"""A test-only fault on the sending side of the data plane: spoil KV payloads in flight,
so that fault-injection runs (``bench/chaos.py``) can show the receiver's checksum
catching them.

Off unless the environment variable ``PDSERVE_TEST_CORRUPT_KV`` names a file when the
sender is made; never set it in a deployment. While it is set, the file's content
(re-read at most every ``RECHECK_S``) says which attempts of each chunk to spoil:

    first   attempt 0 only: the receiver answers "resend" and the clean second attempt
            goes through; the transfer completes
    all     every attempt: the second mismatch fails the transfer, and the decode
            worker falls back to prefilling locally
    other, or no file: nothing is spoiled

The caller's payload is never touched: a copy with one byte flipped goes out under the
checksum of the original, which is what a bit flip on a wire would look like.
"""

from __future__ import annotations

import os
import time

from common.transfer import wire

ENV = "PDSERVE_TEST_CORRUPT_KV"
RECHECK_S = 0.1


class CorruptKV:
    """Reads the mode file named by ``PDSERVE_TEST_CORRUPT_KV``; ``apply`` spoils."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._mode = ""
        self._read_at = float("-inf")
        self.spoiled = 0

    def mode(self) -> str:
        now = time.monotonic()
        if now - self._read_at >= RECHECK_S:
            self._read_at = now
            try:
                with open(self.path, encoding="utf-8") as f:
                    self._mode = f.read(16).strip()
            except OSError:  # no file: off
                self._mode = ""
        return self._mode

    def apply(self, view: memoryview, attempt: int) -> tuple[memoryview, int | None]:
        """``(payload to send, checksum to claim)``: ``(view, None)`` when this attempt
        is left alone (the backend then computes the checksum as usual)."""
        mode = self.mode()
        if not view.nbytes or not (mode == "all" or (mode == "first" and attempt == 0)):
            return view, None
        spoiled = bytearray(view)
        spoiled[len(spoiled) // 2] ^= 0xFF
        self.spoiled += 1
        return memoryview(spoiled), wire.checksum(view)


def from_env() -> CorruptKV | None:
    path = os.environ.get(ENV, "")
    return CorruptKV(path) if path else None
