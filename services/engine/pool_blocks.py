"""Prefix-cache blocks to and from the cache pool, as one buffer per block.

The cache pool stores a block under its chain hash as ``KVStore.export_block_bytes``
bytes (every layer). ``export`` reads blocks this engine has cached; ``adopt`` enters
blocks fetched from the pool into the prefix cache as if computed here, so the next
request with that prefix finds them as ordinary prefix hits.

Neither makes the engine thread wait for a device: ``export_async`` starts the copy to the
host (the caller waits for the bytes elsewhere) and ``adopt`` queues the copy to the
device ahead of the next step (``kv_store.start_block_export`` / ``import_blocks``).
"""

from __future__ import annotations

from collections.abc import Sequence

from services.engine.block_manager import BlockManager
from services.engine.kv_store import (
    Buffer,
    KVStore,
    PendingBlocks,
    import_blocks,
    start_block_export,
)


class PoolBlocks:
    def __init__(self, blocks: BlockManager, kv_store: KVStore) -> None:
        self.blocks = blocks
        self.kv_store = kv_store

    def _chunks(self, token_ids: Sequence[int], n: int) -> list[list[int]]:
        bs = self.blocks.block_size
        return [list(token_ids[i * bs:(i + 1) * bs]) for i in range(n)]

    def adopt(self, hashes: Sequence[int], token_ids: Sequence[int], start: int,
              data: Sequence[Buffer]) -> int:
        """Put KV blocks fetched from elsewhere (one ``export_block_bytes`` buffer each)
        into the prefix cache as chain blocks ``start, start + 1, …`` of ``hashes`` over
        ``token_ids``.

        Blocks ``0 .. start-1`` must be cached here already (they are held meanwhile, so
        adopting cannot evict them). Adopts fewer when free blocks run short, none when
        the held prefix is shorter than ``start``. Returns how many were adopted; raises
        ValueError, having adopted none, when a buffer is not one block of this layout."""
        hashes = list(hashes)
        if start < 0 or start + len(data) > len(hashes):
            raise ValueError(f"blocks {start}..{start + len(data)} outside a chain of "
                             f"{len(hashes)}")
        size = self.kv_store.block_nbytes
        if any(memoryview(b).nbytes != size for b in data):
            raise ValueError(f"every adopted block must be {size} bytes")
        blocks = self.blocks
        chunks = self._chunks(token_ids, start + len(data))
        held = blocks.match_prefix(hashes[:start], chunks[:start])
        if len(held) < start:
            return 0
        blocks.acquire(held)
        ids = blocks.allocate(min(len(data), blocks.num_free_blocks))
        try:
            import_blocks(self.kv_store, ids, data[:len(ids)])
            for i, block_id in enumerate(ids):
                blocks.cache_block(block_id, hashes[start + i], chunks[start + i])
        finally:
            blocks.free(list(reversed(held + ids)))  # tail first: evicted before the head
        return len(ids)

    def export(self, hashes: Sequence[int]) -> list[memoryview]:
        """The bytes of the leading blocks of ``hashes`` still in the prefix cache; stops
        at the first that is not."""
        return self.export_async(hashes).wait()

    def export_async(self, hashes: Sequence[int]) -> PendingBlocks:
        """:meth:`export`, started: ``count`` blocks whose bytes ``wait()`` gives. Their
        copy is queued before anything later can reuse the blocks, so they may be evicted
        as soon as this returns."""
        ids = []
        for h in hashes:
            block_id = self.blocks.block_for_hash(h)
            if block_id is None:
                break
            ids.append(block_id)
        return start_block_export(self.kv_store, ids)
