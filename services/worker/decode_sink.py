"""The decode role's data-plane sink: received KV into the blocks reserved for it.

Two ways in (``common/transfer/base.py``): the sink call copies a verified chunk into
the blocks (``EngineLoop.import_layer``); or, where the receiver copies a chunk out of
somewhere anyway (shm), ``landing`` names the blocks' own memory (``kv_landing.py``),
the receiver copies and hashes in one pass, and ``landed`` follows once the digest
matched. Bytes written through ``landing`` are not KV until then, and nothing takes
them for KV before the transfer is DONE: the blocks get no hash (prefix cache, pool
write-back) until ``complete_remote_prefill``, which waits for DONE; a transfer that
fails is prefilled here instead, recomputed into blocks reserved anew.

Every call runs on the receiver's event loop, off the engine thread: safe for blocks
reserved for a request waiting for its KV (see ``EngineLoop.import_layer``), since every
path that ends the wait (complete, fall back, abort) ends the transfer, and so these
calls, before it touches the engine.
"""

from __future__ import annotations

from collections.abc import Callable

from common.transfer import TransferError
from services.worker.decode_state import Remote
from services.worker.engine_loop import EngineLoop


class DecodeSink:
    """A ``LandingSink`` (and a ``SliceSink`` through ``on_slice``) over the requests in
    ``remote``; ``received_bytes`` counts the verified bytes it took."""

    def __init__(self, remote: dict[str, Remote], loop: EngineLoop, metrics,
                 ranks: Callable[[], bool]) -> None:
        self._remote = remote  # the role's: a request is in it while it may take KV
        self._loop = loop
        self._metrics = metrics
        self._ranks = ranks  # whether other tensor-parallel ranks take their own heads
        self.received_bytes = 0

    def _reserved(self, rid: str, block_ids: list[int]) -> None:
        """``TransferError`` unless ``rid`` waits for KV into exactly ``block_ids``."""
        remote = self._remote.get(rid)
        if remote is None:
            raise TransferError(f"no KV expected for {rid}")
        want = remote.slots.block_ids[remote.slots.num_cached_blocks:]
        if block_ids != want:
            raise TransferError(f"KV for blocks {block_ids[:4]}…, reserved {want[:4]}…")

    def __call__(self, rid: str, layer: int, block_ids: list[int], payload: memoryview,
                 heads: tuple[int, int, int] | None = None) -> None:
        """Write one layer's KV (or, with ``heads``, one rank's slice of its heads)
        straight into the reserved blocks."""
        self._reserved(rid, block_ids)
        try:
            if heads is None:
                self._loop.import_layer(layer, block_ids, payload)
            else:
                self._loop.import_layer_slice(layer, block_ids, heads, payload)
        except ValueError as exc:
            raise TransferError(str(exc)) from exc
        self.count(len(payload))

    def on_slice(self, rid: str, layer: int, block_ids: list[int],
                 heads: tuple[int, int, int], payload: memoryview) -> None:
        self(rid, layer, block_ids, payload, heads)

    def landing(self, rid: str, layer: int, block_ids: list[int],
                nbytes: int) -> list[memoryview] | None:
        """The reserved blocks' K pieces, then V, for one layer's chunk of ``nbytes``;
        None (the sink call takes it) where the cache is not laid out for it."""
        self._reserved(rid, block_ids)
        if self._ranks():  # this rank's cache holds only its own heads
            return None
        try:
            return self._loop.landing(layer, block_ids, nbytes)
        except ValueError as exc:
            raise TransferError(str(exc)) from exc

    def landed(self, rid: str, layer: int, block_ids: list[int], nbytes: int) -> None:
        """The chunk ``landing`` placed was verified: count it."""
        self._reserved(rid, block_ids)
        self.count(nbytes)

    def landing_many(self, rid: str, layers: list[int], block_ids: list[list[int]],
                     sizes: list[int]) -> list[memoryview] | None:
        """``landing`` for a batch's chunks at once (``common/transfer/landing.py``): the
        same checks, every chunk's blocks the reserved ones, each layer in range."""
        want = self._reserved_all(rid, block_ids)
        if self._ranks():
            return None
        try:
            return self._loop.landing_many(layers, want, sizes)
        except ValueError as exc:
            raise TransferError(str(exc)) from exc

    def landed_many(self, rid: str, layers: list[int], block_ids: list[list[int]],
                    sizes: list[int]) -> None:
        """The batch ``landing_many`` placed was verified: count it."""
        self._reserved_all(rid, block_ids)
        self.count(sum(sizes))

    def _reserved_all(self, rid: str, block_ids: list[list[int]]) -> list[int]:
        """The blocks ``rid`` waits for KV into; ``TransferError`` unless every chunk's
        ``block_ids`` are exactly those (a request's layers all name the same blocks)."""
        remote = self._remote.get(rid)
        if remote is None:
            raise TransferError(f"no KV expected for {rid}")
        want = remote.slots.block_ids[remote.slots.num_cached_blocks:]
        if block_ids.count(want) != len(block_ids):  # compared at C speed
            bad = next(b for b in block_ids if b != want)
            raise TransferError(f"KV for blocks {bad[:4]}…, reserved {want[:4]}…")
        return want

    def count(self, nbytes: int) -> None:
        self.received_bytes += nbytes
        self._metrics.kv_transfer_bytes.inc(nbytes)
