"""Which cache-pool instance owns a block: rendezvous (highest random weight) hashing.

Every instance gets a weight per key, ``xxh3_64(key as 8 little-endian bytes ‖ instance
id as UTF-8)``; the owner is the instance with the highest weight, ties broken by the
larger instance id. The same inputs give the same owner in every process on every host
(no Python ``hash()``, no seed from the environment). Removing an instance moves only the
keys it owned, each to its second choice; adding one takes about ``1/n`` of the keys,
all of them from the others' share.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

from common.pool.keys import check_key


def weight(key: int, instance: str) -> int:
    """The rendezvous weight of ``instance`` for ``key``, a 64-bit int."""
    return xxhash.xxh3_64_intdigest(key.to_bytes(8, "little") + instance.encode())


def _check(key: int, instances: Sequence[str]) -> None:
    check_key(key)
    if not instances:
        raise ValueError("no instances to place a block on")
    if len(set(instances)) != len(instances):
        raise ValueError(f"duplicate instance ids in {list(instances)}")


def owners(key: int, instances: Sequence[str], replicas: int) -> list[str]:
    """The ``replicas`` instances that hold ``key``, best first (the first is ``owner``).

    Raises ValueError if ``instances`` is empty or has duplicates, or ``replicas`` is not
    in ``1..len(instances)``.
    """
    _check(key, instances)
    if not 1 <= replicas <= len(instances):
        raise ValueError(f"replicas must be in 1..{len(instances)}, got {replicas}")
    ranked = sorted(instances, key=lambda i: (weight(key, i), i), reverse=True)
    return ranked[:replicas]


def owner(key: int, instances: Sequence[str]) -> str:
    """The instance that owns ``key``."""
    _check(key, instances)
    return max(instances, key=lambda i: (weight(key, i), i))
