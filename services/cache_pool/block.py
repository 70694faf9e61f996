"""The store's side of a block (keys and bytes are validated by ``common.pool.keys``):
what a tier hands back when it evicts, and the check a tier makes of its policy."""

from __future__ import annotations

from typing import NamedTuple

from services.cache_pool.eviction import EvictionPolicy


class Evicted(NamedTuple):
    """A block a tier evicted, handed back so the caller can demote it."""

    key: int
    data: bytes
    depth: int


def check_empty_policy(policy: EvictionPolicy) -> None:
    if len(policy) != 0:
        raise ValueError(f"the policy must start empty, it tracks {len(policy)} keys")
