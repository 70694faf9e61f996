"""Where a received KV chunk lands on a decode worker: the reserved blocks' own memory.

A chunk of one layer for blocks ``b0, b1, …`` is ``[2, n, block_size, kv_heads, head_dim]``:
the K of each block, then the V of each. In a CPU ``KVCache`` each block of ``k[layer]``
and ``v[layer]`` is one contiguous span, so the chunk's bytes are, back to back, those
spans (a run of consecutive block ids is one span)::

    payload   | K b0 | K b1 | K b2 | V b0 | V b1 | V b2 |
    views     |  k[layer, b0:b2+1]  |  v[layer, b0:b2+1]  |     (b0, b1, b2 consecutive)

so the data plane may copy a chunk straight there (``common/transfer/base.py``'s
``LandingSink``) instead of the sink copying it again after the checksum. Any other
layout (a device cache, tensor-parallel shards, another dtype, strided tensors) has no
such views: ``KVLanding.of`` gives None and chunks go through the sink call.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


class KVLanding:
    """Writable byte views of a CPU KV cache's blocks, over its tensors' own memory."""

    __slots__ = ("_k", "_v", "_num_layers", "_num_blocks", "_block")

    def __init__(self, cache) -> None:
        k, v = cache.k, cache.v
        self._num_layers, self._num_blocks = k.shape[0], k.shape[1]
        self._block = k[0, 0].numel() * k.element_size()  # one block's K in one layer
        # Built once: slicing a memoryview per chunk costs far less than a tensor view.
        self._k, self._v = _bytes_of(k), _bytes_of(v)

    @classmethod
    def of(cls, store) -> KVLanding | None:
        """Views for ``store``, or None where its memory is not laid out as above."""
        if "torch" not in sys.modules:  # a simulated engine: no tensors, no torch import
            return None
        import torch

        from services.engine.kv_cache import KVCache

        # Caches whose blocks are all their bytes: float ones, and int8 (each row carries
        # its scale, kernels/kv_int8.py); a cache keeping scales elsewhere would not be.
        plain = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int8)
        if type(store) is not KVCache:  # a tensor-parallel or simulated store
            return None
        k, v = store.k, store.v
        if (k.device.type != "cpu" or v.device.type != "cpu"
                or k.dtype not in plain
                or v.dtype != k.dtype or k.shape != v.shape or k.dim() != 5
                or not (k.is_contiguous() and v.is_contiguous())):
            return None
        return cls(store)

    def views(self, layer: int, block_ids: Sequence[int], nbytes: int) -> list[memoryview]:
        """The K spans of ``block_ids`` in ``layer``, then their V spans, ``nbytes`` in
        all; ``ValueError`` for a layer or block id out of range, or a length that is not
        that many blocks (as ``KVCache.import_layer_bytes``)."""
        return self.views_many((layer,), block_ids, (nbytes,))

    def views_many(self, layers: Sequence[int], block_ids: Sequence[int],
                   sizes: Sequence[int]) -> list[memoryview]:
        """``views`` of each of ``layers`` in turn (``sizes[i]`` bytes for ``layers[i]``)
        for the same ``block_ids``, back to back: the ids checked and cut into runs once,
        not once a layer. The same ``ValueError``s, before any view is made."""
        if len(layers) != len(sizes):
            raise ValueError(f"{len(layers)} layers, {len(sizes)} sizes")
        for layer in layers:
            if not (isinstance(layer, int) and 0 <= layer < self._num_layers):
                raise ValueError(f"layer {layer} outside 0..{self._num_layers - 1}")
        ids = [int(b) for b in block_ids]
        if ids and (min(ids) < 0 or max(ids) >= self._num_blocks):
            raise ValueError(f"block ids out of range 0..{self._num_blocks - 1}")
        nbytes = 2 * self._block * len(ids)
        if sizes.count(nbytes) != len(sizes):
            bad = next(n for n in sizes if n != nbytes)
            raise ValueError(f"KV payload of {bad} bytes for {len(ids)} blocks of "
                             f"{2 * self._block} bytes")
        spans = [(first * self._block, count * self._block) for first, count in _runs(ids)]
        out = []
        for layer in layers:
            base = layer * self._num_blocks * self._block
            for whole in (self._k, self._v):
                for at, size in spans:
                    out.append(whole[base + at : base + at + size])
        return out


def _runs(ids: list[int]) -> list[tuple[int, int]]:
    """``ids`` as (first, count) runs of consecutive ids, in order."""
    runs: list[tuple[int, int]] = []
    for b in ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


def _bytes_of(tensor) -> memoryview:
    """A contiguous CPU tensor's memory as one writable byte view (no copy)."""
    import torch

    return memoryview(tensor.view(-1).view(torch.uint8).numpy()).cast("B")

