"""What a block is to the cache pool and its clients: a 64-bit key (the block hash),
opaque bytes, and its depth in the hash chain, validated once on either side."""

from __future__ import annotations

Buffer = bytes | bytearray | memoryview

MAX_DEPTH = 2**32 - 1
"""The deepest position a block may have: the SSD index stores a depth as a uint32."""


def check_key(key: int) -> None:
    """Raise unless ``key`` is a 64-bit unsigned int (a block hash)."""
    if not isinstance(key, int) or isinstance(key, bool):
        raise TypeError(f"block key must be an int, got {type(key).__name__}")
    if not 0 <= key < 2**64:
        raise ValueError(f"block key must be in [0, 2**64), got {key}")


def check_block(key: int, data: Buffer, depth: int) -> memoryview:
    """Validate a block; returns its bytes as a flat byte view (len = byte count)."""
    check_key(key)
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TypeError(f"block data must be bytes-like, got {type(data).__name__}")
    if not 0 <= depth <= MAX_DEPTH:
        raise ValueError(f"depth must be in [0, {MAX_DEPTH}], got {depth}")
    view = memoryview(data)
    if not view.c_contiguous:
        raise ValueError("block data must be contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view
