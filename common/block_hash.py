"""Content-addressed identity of full KV blocks.

Block ``i`` of a sequence is named by a chained hash::

    hash_i = xxh3_64(hash_{i-1} ‖ tokens of block i ‖ model fingerprint ‖ cache salt)

with ``hash_{-1} = ROOT_PARENT_HASH`` and a fixed seed, so every process on every host
derives the same names for the same prefix. Only full blocks are hashed: a partial tail
block may still grow and has no stable identity.

Byte layout hashed for one block (all integers little-endian, whatever the platform)::

    parent hash      u64
    token count      u32
    token ids        u32 × count
    fingerprint      u32 byte length, then UTF-8 bytes
    cache salt       u8 0                           (salt is None)
                     u8 1, u32 byte length, UTF-8   (salt is a string, possibly "")

Changing this layout changes every hash; ``tests/test_block_hash.py`` pins one value.
This module must stay free of torch and numpy so that light processes can import it.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

# Names the hash function and the byte layout above; change it with either, so that
# workers hashing differently are told apart at handshake.
BLOCK_HASH_ALGORITHM: str = "xxh3_64-chain-v1"
BLOCK_HASH_SEED: int = 0x7064_7365_7276_6531  # "pdserve1" in ASCII
ROOT_PARENT_HASH: int = 0x6B76_2D72_6F6F_7430  # "kv-root0" in ASCII

_U64_MAX = (1 << 64) - 1
_U32_MAX = (1 << 32) - 1


def _length_prefixed(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("<I", len(raw)) + raw


def hash_block(
    parent_hash: int,
    token_ids: Sequence[int],
    fingerprint: str,
    cache_salt: str | None = None,
) -> int:
    """Return the unsigned 64-bit hash of one block given its parent's hash.

    Raises ValueError when ``parent_hash`` is not a u64 or a token id is not a u32.
    """
    if not 0 <= parent_hash <= _U64_MAX:
        raise ValueError(f"parent_hash {parent_hash} is not an unsigned 64-bit integer")
    count = len(token_ids)
    try:
        tokens = struct.pack(f"<I{count}I", count, *token_ids)
    except struct.error as exc:
        raise ValueError(f"token ids must be integers in [0, {_U32_MAX}]: {exc}") from exc
    salt = b"\x00" if cache_salt is None else b"\x01" + _length_prefixed(cache_salt)
    data = struct.pack("<Q", parent_hash) + tokens + _length_prefixed(fingerprint) + salt
    return xxhash.xxh3_64_intdigest(data, seed=BLOCK_HASH_SEED)


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    fingerprint: str,
    cache_salt: str | None = None,
    parent_hash: int = ROOT_PARENT_HASH,
) -> list[int]:
    """Return the chained hashes of the ``len(token_ids) // block_size`` full blocks.

    ``parent_hash`` is the hash of the block before ``token_ids[0]``; pass the last hash
    already known to extend a chain. Raises ValueError when ``block_size`` is not positive.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    hashes: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block(
            parent_hash, token_ids[start : start + block_size], fingerprint, cache_salt
        )
        hashes.append(parent_hash)
    return hashes
