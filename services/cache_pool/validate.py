"""Checks on cache-pool requests, made before the store sees them.

Each check raises ``BadRequest``, which the server answers with
``Error("bad_request", <message>)``; a request that fails a check changes nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from common.pool.keys import MAX_DEPTH

KEY_LIMIT = 2**64  # keys are uint64 block hashes
MAX_TRANSFER_ID = 128  # characters
MAX_LEASE_S = 300.0


class BadRequest(ValueError):
    """A well-formed message whose contents the pool cannot accept."""


def check_keys(keys: Sequence[int]) -> None:
    """Every key is a uint64 (msgpack already made them ints)."""
    for i, key in enumerate(keys):
        if not 0 <= key < KEY_LIMIT:
            raise BadRequest(f"keys[{i}] = {key} is not a uint64")


def check_no_bulk(kind: str, bulk: Sequence[memoryview]) -> None:
    if bulk:
        raise BadRequest(f"{kind} takes no bulk frames, got {len(bulk)}")


def check_put(keys: Sequence[int], depths: Sequence[int], block_bytes: int, *,
              pool_block_bytes: int, max_request_bytes: int) -> None:
    """A PoolPut's contents: as many depths as keys; every key a uint64; every depth in
    ``[0, MAX_DEPTH]``; ``block_bytes`` positive and equal to ``pool_block_bytes`` unless
    that is 0 (not learned yet); the blocks' total at most ``max_request_bytes``."""
    if len(keys) != len(depths):
        raise BadRequest(f"{len(keys)} keys and {len(depths)} depths: they must be equal")
    if block_bytes <= 0:
        raise BadRequest(f"block_bytes must be positive, got {block_bytes}")
    if pool_block_bytes and block_bytes != pool_block_bytes:
        raise BadRequest(f"block_bytes {block_bytes} differs from the pool's "
                         f"{pool_block_bytes}")
    if len(keys) * block_bytes > max_request_bytes:
        raise BadRequest(f"{len(keys)} blocks of {block_bytes} bytes exceed "
                         f"max_request_bytes {max_request_bytes}")
    check_keys(keys)
    for i, depth in enumerate(depths):
        if not 0 <= depth <= MAX_DEPTH:
            raise BadRequest(f"depths[{i}] = {depth} is outside [0, {MAX_DEPTH}]")


def put_items(keys: Sequence[int], depths: Sequence[int], block_bytes: int,
              bulk: Sequence[memoryview], *, pool_block_bytes: int,
              max_request_bytes: int) -> list[tuple[int, memoryview, int]]:
    """The ``(key, data, depth)`` items of a PoolPut whose blocks came as bulk frames.

    Requires ``check_put``, as many bulk frames as keys, and every frame exactly
    ``block_bytes`` long.
    """
    if not len(keys) == len(depths) == len(bulk):
        raise BadRequest(f"{len(keys)} keys, {len(depths)} depths and {len(bulk)} bulk "
                         "frames: they must be equal")
    check_put(keys, depths, block_bytes, pool_block_bytes=pool_block_bytes,
              max_request_bytes=max_request_bytes)
    for i, frame in enumerate(bulk):
        if frame.nbytes != block_bytes:
            raise BadRequest(f"bulk frame {i} is {frame.nbytes} bytes, "
                             f"block_bytes is {block_bytes}")
    return list(zip(keys, bulk, depths, strict=True))


def check_transfer(transfer_id: str, lease_s: float) -> None:
    """A data-plane transfer named by a request: a non-empty id of at most
    ``MAX_TRANSFER_ID`` characters, and a lease in ``(0, MAX_LEASE_S]`` seconds."""
    if not transfer_id or len(transfer_id) > MAX_TRANSFER_ID:
        raise BadRequest(f"transfer_id must be 1 to {MAX_TRANSFER_ID} characters, "
                         f"got {len(transfer_id)}")
    if not (math.isfinite(lease_s) and 0 < lease_s <= MAX_LEASE_S):
        raise BadRequest(f"lease_s must be in (0, {MAX_LEASE_S}], got {lease_s}")


def check_get(keys: Sequence[int], bulk: Sequence[memoryview], *, pool_block_bytes: int,
              max_request_bytes: int) -> None:
    """A PoolGet whose reply could hold every key fits ``max_request_bytes``."""
    check_no_bulk("pool_get", bulk)
    check_keys(keys)
    if len(keys) * pool_block_bytes > max_request_bytes:
        raise BadRequest(f"{len(keys)} keys of {pool_block_bytes} bytes could exceed "
                         f"max_request_bytes {max_request_bytes}; ask in smaller batches")
