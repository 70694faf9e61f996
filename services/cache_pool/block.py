"""What a block is to the cache pool: a 64-bit key and opaque bytes, validated once."""

from __future__ import annotations

from typing import NamedTuple

from services.cache_pool.disk_format import MAX_DEPTH
from services.cache_pool.eviction import EvictionPolicy

Buffer = bytes | bytearray | memoryview


class Evicted(NamedTuple):
    """A block a tier evicted, handed back so the caller can demote it."""

    key: int
    data: bytes
    depth: int


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


def check_empty_policy(policy: EvictionPolicy) -> None:
    if len(policy) != 0:
        raise ValueError(f"the policy must start empty, it tracks {len(policy)} keys")
