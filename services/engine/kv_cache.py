"""The paged KV cache tensors: the torch implementation of the ``KVStore`` contract.

Layout: K and V are each ``[layers, num_blocks, block_size, kv_heads, head_dim]``, so a
run of consecutive block ids in one layer is one contiguous span of memory. An int8
cache's last dimension is ``head_dim + 4``: each row's values, then its float32 scale
(kernels/kv_int8.py), so a block's bytes are still all it takes to move it.

Exports use one byte layout, the same in every engine that shares a model fingerprint::

    a layer's blocks   [0 = K | 1 = V, i, token_in_block, kv_head, head_dim]   for block_ids[i]
    one block          [layer, 0 = K | 1 = V, token_in_block, kv_head, head_dim]

Bytes exported from one engine's blocks can be imported into any block ids of another
engine with the same model, dtype and block size.

On the CPU an export is one gather whose memory the returned view shares, and an import
reads the caller's bytes in place. On CUDA the blocks are packed on the device (the
Triton kernel where triton is installed) and copied once into a pooled pinned host
buffer, on a side stream the compute stream never waits for
(``services/engine/host_buffers.py``; ``export_layer_async`` and
``export_blocks_async`` let the caller wait later). The pack itself runs on the compute
stream: it is a device-to-device gather of microseconds, and queued there it reads the
blocks before any later step can reuse them (a pooled block is an evictable one). Pool
imports (``import_blocks_bytes``) go the other way: staged in a pinned buffer, copied and
scattered on the side stream, the compute stream made to wait for them by an event.
"""

from __future__ import annotations

import ctypes
import importlib.util
import math
import sys
import warnings
from collections.abc import Sequence

import torch

from kernels.kv_int8 import row_width
from services.engine.host_buffers import HostBufferPool, PendingBytes, SideStream
from services.engine.kv_store import Buffer


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: str | torch.device = "cpu") -> None:
        shape = (num_layers, num_blocks, block_size, num_kv_heads, row_width(head_dim, dtype))
        self.k = _zeros(shape, dtype, torch.device(device))
        self.v = _zeros(shape, dtype, torch.device(device))
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        # The pack/unpack kernels serve CUDA caches; elsewhere torch's gathers do.
        on_cuda = self.k.device.type == "cuda"
        self._kernels = on_cuda and importlib.util.find_spec("triton") is not None
        # Exports off a device land in reused host buffers, copied on a side stream.
        self._host = None if self.k.device.type == "cpu" else HostBufferPool(pin=on_cuda)
        self._side = SideStream(self.k.device) if on_cuda else None

    def close(self) -> None:
        """Free the idle host buffers (buffers still held are freed when dropped)."""
        if self._host is not None:
            self._host.close()

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        row = row_width(head_dim, dtype)
        return 2 * num_layers * block_size * num_kv_heads * row * itemsize

    def check_ids(self, block_ids: Sequence[int]) -> list[int]:
        """``block_ids`` as ints; ``ValueError`` if one is out of range."""
        ids = [int(i) for i in block_ids]  # checked on the host: no device round trip
        if ids and (min(ids) < 0 or max(ids) >= self.num_blocks):
            raise ValueError(f"block ids out of range 0..{self.num_blocks - 1}")
        return ids

    def _ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        ids = self.check_ids(block_ids)
        return torch.tensor(ids, dtype=torch.long, device=self.k.device)

    def export_layer(self, layer: int, block_ids: Sequence[int]) -> torch.Tensor:
        """One layer's K and V of ``block_ids`` as a new contiguous ``[2, n, ...]`` tensor."""
        ids = self._ids(block_ids)
        if self._kernels:
            from kernels.kv_pack import kv_pack

            return kv_pack(self.k[layer], self.v[layer], ids)
        return torch.stack([self.k[layer].index_select(0, ids),
                            self.v[layer].index_select(0, ids)])

    def import_layer(self, layer: int, block_ids: Sequence[int], buffer: torch.Tensor) -> None:
        """Write a buffer from :meth:`export_layer` into ``block_ids`` of this cache."""
        ids = self._ids(block_ids)
        expected = (2, len(ids), *self.k.shape[2:])
        if tuple(buffer.shape) != expected or buffer.dtype != self.k.dtype:
            raise ValueError(f"KV buffer must be {expected} {self.k.dtype}, "
                             f"got {tuple(buffer.shape)} {buffer.dtype}")
        if self._kernels:
            from kernels.kv_pack import kv_unpack

            kv_unpack(buffer.to(self.k.device), self.k[layer], self.v[layer], ids)
            return
        self.k[layer].index_copy_(0, ids, buffer[0].to(self.k.device))
        self.v[layer].index_copy_(0, ids, buffer[1].to(self.v.device))

    def export_layer_bytes(self, layer: int, block_ids: Sequence[int]) -> memoryview:
        """:meth:`export_layer` as raw bytes, in a new buffer the view keeps alive."""
        return self.export_layer_async(layer, block_ids).wait()

    def export_layer_async(self, layer: int, block_ids: Sequence[int]) -> PendingBytes:
        """:meth:`export_layer_bytes`, started: on CUDA the pack and the copy to the host
        run on the side stream after what the compute stream has queued so far, and
        ``wait()`` blocks until they are done; on the CPU the bytes are ready at once."""
        if self._host is None:
            return PendingBytes.ready_now(_cpu_bytes(self.export_layer(layer, block_ids)))
        return self._to_host(lambda: self.export_layer(layer, block_ids))

    def _to_host(self, pack) -> PendingBytes:
        """``pack()``'s tensor copied into a pooled host buffer (on the side stream on
        CUDA, where the copy does not block this thread)."""
        packed = pack()  # on the compute stream: ordered before any reuse of the blocks
        buf = self._host.take(packed.numel() * packed.element_size())

        def copy() -> torch.Tensor:
            buf.view(packed.dtype).view(packed.shape).copy_(
                packed, non_blocking=self._side is not None)
            return buf

        if self._side is None:
            return PendingBytes(copy(), None, self._host.view)
        _, done = self._side.run(copy)
        return PendingBytes(buf, done, self._host.view, keep=packed)

    def import_layer_bytes(self, layer: int, block_ids: Sequence[int],
                           payload: Buffer) -> None:
        """Write bytes from :meth:`export_layer_bytes` into ``block_ids``; ``ValueError``
        if their length does not fit that many blocks of this layout."""
        payload = memoryview(payload)
        per_block = 2 * self.k[0, 0].numel() * self.k.element_size()
        if payload.nbytes != per_block * len(block_ids):
            raise ValueError(f"KV payload of {payload.nbytes} bytes for {len(block_ids)} "
                             f"blocks of {per_block} bytes")
        with warnings.catch_warnings():  # a read-only buffer is fine: import copies it
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(payload, dtype=torch.uint8)
        buf = raw.view(self.k.dtype).view(2, len(block_ids), *self.k.shape[2:])
        self.import_layer(layer, block_ids, buf)

    def import_layer_slice_bytes(self, layer: int, block_ids: Sequence[int],
                                 heads: tuple[int, int, int], payload: Buffer) -> None:
        """Write one tensor-parallel rank's slice of the KV heads, heads ``[start, start +
        count)`` of ``total`` as ``[2, n, token, count, head_dim]`` bytes, into those
        heads of ``block_ids``; ``ValueError``, writing nothing, if it does not fit."""
        start, count, total = heads
        _, _, block_size, num_heads, head_dim = self.k.shape
        if total != num_heads or count < 1 or start + count > num_heads:
            raise ValueError(f"head slice [{start}, {start + count}) of {total} heads "
                             f"for a cache of {num_heads}")
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} outside 0..{self.num_layers - 1}")
        ids = self._ids(block_ids)
        payload = memoryview(payload)
        shape = (2, len(block_ids), block_size, count, head_dim)
        want = math.prod(shape) * self.k.element_size()
        if payload.nbytes != want:
            raise ValueError(f"KV slice of {payload.nbytes} bytes where {want} fit "
                             f"{len(block_ids)} blocks of {count} heads")
        with warnings.catch_warnings():  # a read-only buffer is fine: the copy below
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(payload, dtype=torch.uint8)
        buf = raw.view(self.k.dtype).view(shape).to(self.k.device)
        heads_of = slice(start, start + count)
        self.k[layer, :, :, heads_of].index_copy_(0, ids, buf[0])
        self.v[layer, :, :, heads_of].index_copy_(0, ids, buf[1])

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block across all layers, K and V (a cache-pool block)."""
        return 2 * self.k[:, 0].numel() * self.k.element_size()

    def export_block_bytes(self, block_id: int) -> memoryview:
        """One block, all layers, as ``[layer, 0 = K | 1 = V, token, kv_head, head_dim]``
        bytes."""
        return self.export_blocks_async([block_id]).wait()

    def export_blocks_async(self, block_ids: Sequence[int]) -> PendingBytes:
        """:meth:`export_block_bytes` of each of ``block_ids``, one after the other in
        one buffer, started: on CUDA gathered on the compute stream and copied to the host
        on the side stream (``wait()`` blocks until then); on the CPU one gather whose
        memory the bytes are, ready at once."""
        ids = self._ids(block_ids)
        n, rest = len(block_ids), self.k.shape[2:]

        def pack() -> torch.Tensor:
            out = torch.empty((n, self.num_layers, 2, *rest), dtype=self.k.dtype,
                              device=self.k.device)
            if self.k.device.type == "cpu":  # straight from the cache: one copy
                for i, b in enumerate(block_ids):
                    out[i, :, 0].copy_(self.k[:, b])
                    out[i, :, 1].copy_(self.v[:, b])
            elif n:  # a few launches, not 2n
                out[:, :, 0].copy_(self.k.index_select(1, ids).transpose(0, 1))
                out[:, :, 1].copy_(self.v.index_select(1, ids).transpose(0, 1))
            return out

        if self._host is None:
            return PendingBytes.ready_now(_cpu_bytes(pack()))
        return self._to_host(pack)

    def import_block_bytes(self, block_id: int, data: Buffer) -> None:
        """Write bytes from :meth:`export_block_bytes` into ``block_id``; ``ValueError``
        if they are not one block of this layout."""
        self.import_blocks_bytes([block_id], [data])

    def import_blocks_bytes(self, block_ids: Sequence[int], data: Sequence[Buffer]) -> None:
        """:meth:`import_block_bytes` of ``data[i]`` into ``block_ids[i]``, all checked
        before any is written. On CUDA the host thread does not wait: the copy runs on the
        side stream and the next step's kernels wait for it on the device."""
        ids = self._ids(block_ids)
        if len(data) != len(block_ids):
            raise ValueError(f"{len(data)} buffers for {len(block_ids)} blocks")
        views = [memoryview(d).cast("B") for d in data]
        for view in views:
            if view.nbytes != self.block_nbytes:
                raise ValueError(f"a block holds {self.block_nbytes} bytes, got "
                                 f"{view.nbytes}")
        if not views:
            return
        if self._side is None:
            for b, view in zip(block_ids, views, strict=True):
                both = _block_tensor(view, self.k)
                if self.k.device.type != "cpu":
                    both = both.to(self.k.device)  # one host-to-device copy, not two
                self.k[:, b].copy_(both[:, 0])
                self.v[:, b].copy_(both[:, 1])
            return
        size = self.block_nbytes
        staged = self._host.take(size * len(views))
        host = staged.numpy()
        for i, view in enumerate(views):  # pageable to pinned: the copy below is async
            host[i * size:(i + 1) * size] = view
        shape = (len(views), self.num_layers, 2, *self.k.shape[2:])

        def scatter() -> None:
            both = staged.view(self.k.dtype).view(shape).to(self.k.device, non_blocking=True)
            self.k.index_copy_(1, ids, both[:, :, 0].transpose(0, 1))
            self.v.index_copy_(1, ids, both[:, :, 1].transpose(0, 1))

        self._host.give_back_when(staged, self._side.run_joined(scatter))


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # Linux's value


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed cache tensor; on a Linux CPU its memory asked for in 2 MiB pages before it
    is first touched. Decode attention reads each sequence's blocks wherever the block
    manager put them: with 4 KiB pages nearly every block was a TLB miss, and the
    compiled kernel took ~1.4x as long as over the same blocks in order (measured with
    ``THP_MEM_ALLOC_ENABLE``, docs/benchmarks.md, "Kernel v10"). Where transparent huge
    pages are off (or madvise fails) the tensor is the same, in small pages."""
    out = torch.empty(shape, dtype=dtype, device=device)
    nbytes = out.numel() * out.element_size()
    if device.type == "cpu" and sys.platform == "linux" and nbytes >= 2 * _HUGE_PAGE:
        start = -(-out.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE  # the aligned inside
        end = (out.data_ptr() + nbytes) // _HUGE_PAGE * _HUGE_PAGE
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start),
                         ctypes.c_int(_MADV_HUGEPAGE))
        except (OSError, AttributeError):
            pass  # no libc madvise here: small pages
    return out.zero_()


def _block_tensor(view: memoryview, like: torch.Tensor) -> torch.Tensor:
    """One block's bytes, read in place, as ``[layer, 2, token, kv_head, head_dim]``."""
    with warnings.catch_warnings():  # a read-only buffer is fine: the caller copies it
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(view, dtype=torch.uint8)
    return raw.view(like.dtype).view(like.shape[0], 2, *like.shape[2:])


def _cpu_bytes(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's own bytes (no copy)."""
    return memoryview(tensor.view(torch.uint8).numpy()).cast("B")
