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
