"""What an engine needs from the memory that holds its KV blocks: the ``KVStore`` contract.

Two stores implement it: the torch ``KVCache`` (``services/engine/kv_cache.py``), whose
tensors the model reads and writes, and the simulated store (``services/engine/sim.py``).
The engine core, the KV handoff and the cache-pool link see only this contract, so this
module imports no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

# Bytes handed in: from the data plane (memoryview), the cache pool (bytes) or an export.
Buffer = bytes | bytearray | memoryview


@runtime_checkable
class KVStore(Protocol):
    """Blocks ``0 .. num_blocks-1`` of ``block_size`` tokens each, over ``num_layers`` layers.

    Contract:
    - A layer's export is ``block_nbytes // num_layers`` bytes per block, the blocks in
      the order given; the bytes are a copy (later writes to the store do not change
      them). Importing the same bytes into any block ids of a store of the same layout
      (model fingerprint) reproduces the blocks exactly.
    - A block's export holds that block across all layers, ``block_nbytes`` bytes; it is
      what the cache pool stores.
    - Block ids out of range, and imports whose length does not fit the blocks given,
      raise ``ValueError`` having written nothing.
    - Which block ids hold what is the block manager's business, not the store's.
    """

    num_layers: int
    num_blocks: int
    block_size: int

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block across all layers (a cache-pool block)."""
        ...

    def export_layer_bytes(self, layer: int, block_ids: Sequence[int]) -> memoryview:
        """Layer ``layer`` of ``block_ids`` as one new buffer."""
        ...

    def import_layer_bytes(self, layer: int, block_ids: Sequence[int],
                           payload: Buffer) -> None:
        """Write bytes from :meth:`export_layer_bytes` into layer ``layer`` of ``block_ids``."""
        ...

    def export_block_bytes(self, block_id: int) -> memoryview:
        """Block ``block_id``, every layer, as one new buffer."""
        ...

    def import_block_bytes(self, block_id: int, data: Buffer) -> None:
        """Write bytes from :meth:`export_block_bytes` into ``block_id``."""
        ...


class PendingBuffer(Protocol):
    """Bytes on their way off a device (``host_buffers.PendingBytes``): ``ready()`` says
    whether ``wait()`` would return at once."""

    def ready(self) -> bool: ...

    def wait(self) -> memoryview: ...


class PendingBlocks:
    """Pool blocks on their way off a device: ``wait()`` gives one view per block (slices
    of one buffer, or the buffers exported one by one); it may block, so callers on an
    event loop wait in a thread unless ``ready()``."""

    def __init__(self, count: int, block_nbytes: int, pending: PendingBuffer | None = None,
                 views: list[memoryview] | None = None) -> None:
        self.count, self._size = count, block_nbytes
        self._pending, self._views = pending, views

    def ready(self) -> bool:
        return self._views is not None or self._pending.ready()

    def wait(self) -> list[memoryview]:
        if self._views is None:
            whole, size = self._pending.wait(), self._size
            self._views = [whole[i * size:(i + 1) * size] for i in range(self.count)]
            self._pending = None
        return self._views


@runtime_checkable
class BlockBatches(Protocol):
    """What a store may add to ``KVStore`` to move several pool blocks per call without
    the host waiting for the device (``KVCache`` does; the others go a block at a time)."""

    def export_blocks_async(self, block_ids: Sequence[int]) -> PendingBuffer:
        """``export_block_bytes`` of each block, in order, in one buffer, started."""
        ...

    def import_blocks_bytes(self, block_ids: Sequence[int], data: Sequence[Buffer]) -> None:
        """``import_block_bytes`` of each, all checked before any is written."""
        ...


def start_block_export(store: KVStore, block_ids: Sequence[int]) -> PendingBlocks:
    """Blocks ``block_ids`` as ``block_nbytes`` each, started where the store can (the
    caller waits for them off the engine thread), else exported now."""
    if isinstance(store, BlockBatches):
        return PendingBlocks(len(block_ids), store.block_nbytes,
                             pending=store.export_blocks_async(block_ids))
    return PendingBlocks(len(block_ids), store.block_nbytes,
                         views=[store.export_block_bytes(b) for b in block_ids])


def import_blocks(store: KVStore, block_ids: Sequence[int], data: Sequence[Buffer]) -> None:
    """``data[i]`` into ``block_ids[i]``; ``ValueError`` having written none when one is
    not a block of this layout."""
    if isinstance(store, BlockBatches):
        store.import_blocks_bytes(block_ids, data)
        return
    size = store.block_nbytes
    if len(data) != len(block_ids) or any(memoryview(d).nbytes != size for d in data):
        raise ValueError(f"every block must be {size} bytes, one per block id")
    for block_id, buf in zip(block_ids, data, strict=True):
        store.import_block_bytes(block_id, buf)
