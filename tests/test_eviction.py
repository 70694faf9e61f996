"""Eviction policies of the cache pool: exact orders, the reuse-aware model, contracts."""

from __future__ import annotations

import math
import random

import pytest

from services.cache_pool.disk_format import BLOCK_HEADER
from services.cache_pool.eviction import (
    EmptyPolicyError,
    LRUPolicy,
    ReuseAwarePolicy,
    ReuseParams,
)
from services.cache_pool.store import BlockStore
from services.cache_pool.tiers import DramTier, SsdTier

POLICIES = [LRUPolicy, ReuseAwarePolicy]


def drain(policy) -> list:
    order = []
    while len(policy):
        key = policy.victim()
        policy.on_remove(key)
        order.append(key)
    return order


def test_lru_exact_order():
    lru = LRUPolicy()
    for key in [1, 2, 3, 4, 5]:
        lru.on_insert(key, depth=key)
    lru.on_access(2)
    lru.on_access(1)
    lru.on_remove(4)
    lru.on_insert(6, depth=0)
    lru.on_access(3)
    assert lru.victim() == lru.victim() == 5  # a query, not a removal
    assert drain(lru) == [5, 2, 1, 6, 3]


def test_reuse_aware_docstring_example():
    # A is shallow and used four times, then B (deep, used once) arrives: LRU would
    # evict A, the least recent; the reuse-aware policy evicts B.
    lru, reuse = LRUPolicy(), ReuseAwarePolicy()
    for policy in (lru, reuse):
        policy.on_insert("A", depth=0)
        for _ in range(3):
            policy.on_access("A")
        policy.on_insert("B", depth=10)
    assert lru.victim() == "A"
    assert reuse.victim() == "B"
    assert reuse.score("A") == pytest.approx(2.0, abs=1e-3)
    depth_bits = ReuseParams().depth_cost * math.log2(11) / ReuseParams().half_life
    assert reuse.score("B") == pytest.approx(-depth_bits, abs=1e-3)


def test_reuse_aware_deeper_block_of_one_request_goes_first():
    reuse = ReuseAwarePolicy(ReuseParams(half_life=1000, depth_cost=50))
    for depth, key in enumerate([10, 11, 12, 13]):  # one request's chain, in order
        reuse.on_insert(key, depth)
    assert drain(reuse) == [13, 12, 11, 10]


def test_reuse_aware_old_frequency_decays_below_fresh_use():
    reuse = ReuseAwarePolicy(ReuseParams(half_life=8, depth_cost=0))
    reuse.on_insert("hot", 0)
    for _ in range(3):
        reuse.on_access("hot")  # score ~4 at tick 4
    reuse.on_insert("fresh", 0)
    assert reuse.victim() == "fresh"  # frequency wins while recent...
    for key in range(20):  # ...20 ticks = 2.5 half-lives later, it does not
        reuse.on_insert(key, 0)
        reuse.on_remove(key)
    reuse.on_access("fresh")
    assert reuse.score("hot") < reuse.score("fresh")
    assert reuse.victim() == "hot"


def test_reuse_aware_remembers_evicted_history():
    reuse = ReuseAwarePolicy(ReuseParams(half_life=1000, depth_cost=0))
    reuse.on_insert("back", 0)
    reuse.on_access("back")
    reuse.on_access("back")
    reuse.on_remove("back")
    reuse.on_insert("new", 0)
    reuse.on_insert("back", 0)  # returns with its decayed score + 1, not 1
    assert reuse.score("back") > 1.5
    assert reuse.victim() == "new"


def test_reuse_aware_victim_is_lowest_score_under_random_ops():
    """Lazy heap entries and compaction never change the answer: compare with a scan."""
    rng = random.Random(7)
    reuse = ReuseAwarePolicy(ReuseParams(half_life=50, depth_cost=10, history_floor=8))
    held: set[int] = set()
    for _ in range(3000):
        op = rng.random()
        if op < 0.4 or not held:
            key = rng.randrange(200)
            if key not in held:
                reuse.on_insert(key, rng.randrange(20))
                held.add(key)
        elif op < 0.85:
            reuse.on_access(rng.choice(sorted(held)))
        else:
            key = reuse.victim()
            assert reuse.score(key) == pytest.approx(min(reuse.score(k) for k in held))
            reuse.on_remove(key)
            held.remove(key)
        assert len(reuse) == len(held)
        assert len(reuse._heap) <= 2 * len(held) + 65  # stale entries stay bounded
        assert len(reuse._ghosts) <= max(8, 4 * len(held))


@pytest.mark.parametrize("make", POLICIES)
def test_policy_contract_errors(make):
    policy = make()
    with pytest.raises(EmptyPolicyError):
        policy.victim()
    policy.on_insert(1, 0)
    with pytest.raises(ValueError):
        policy.on_insert(1, 0)
    with pytest.raises(ValueError):
        policy.on_insert(2, -1)
    with pytest.raises(KeyError):
        policy.on_access(2)
    with pytest.raises(KeyError):
        policy.on_remove(2)
    assert len(policy) == 1 and 1 in policy and 2 not in policy
    policy.on_remove(1)
    with pytest.raises(EmptyPolicyError):
        policy.victim()


@pytest.mark.parametrize("kw", [{"half_life": 0}, {"half_life": math.inf},
                                {"depth_cost": -1}, {"history_ratio": math.nan},
                                {"history_floor": -1}])
def test_reuse_params_rejects_bad_values(kw):
    with pytest.raises(ValueError):
        ReuseParams(**kw)


def test_reuse_aware_drives_real_tiers(tmp_path):
    """Both tiers under the reuse-aware policy: exact bytes, capacities, policy in step."""
    ssd_cap = 8 * (BLOCK_HEADER.size + 32)
    store = BlockStore(DramTier(4 * 32, ReuseAwarePolicy(), block_bytes=32),
                       SsdTier(tmp_path, ssd_cap, ReuseAwarePolicy()))
    rng, hits = random.Random(3), 0
    for _ in range(300):
        keys = [rng.randrange(30) for _ in range(3)]
        if rng.random() < 0.5:
            store.put_many([(k, random.Random(k).randbytes(32), d) for d, k in enumerate(keys)])
        for key, got in zip(keys, store.get_many(keys), strict=True):
            assert got is None or got == random.Random(key).randbytes(32)
            hits += got is not None
        assert store.dram.used_bytes <= 4 * 32 and store.ssd.used_bytes <= ssd_cap
        assert len(store.dram.policy) == len(store.dram) and len(store.ssd.policy) == len(store.ssd)
    assert hits > 100
