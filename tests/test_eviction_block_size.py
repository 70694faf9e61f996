"""The reuse-aware policy counts in tokens: the same tokens in 16- or 512-token blocks
are kept and dropped alike, so a figure measured on 512-token traces holds live."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from bench.cache_hit_ratio import replay, split_chains
from services.cache_pool.eviction import LRUPolicy, ReuseAwarePolicy, ReuseParams
from services.cache_pool.settings import PoolSettings


def conversation_chains(seed: int = 3, requests: int = 400) -> list[list[int]]:
    """Hot shared documents asked about again and again, growing conversations, and long
    one-off prompts that sweep through a small cache (where LRU loses the hot blocks)."""
    rng = random.Random(seed)
    next_id = iter(range(100, 10**9))
    docs = [[10 * d + i for i in range(3)] for d in range(8)]
    convs: list[list[int]] = []
    chains = []
    for _ in range(requests):
        r = rng.random()
        if r < 0.3:
            chains.append(rng.choice(docs) + [next(next_id) for _ in range(rng.randint(1, 2))])
        elif r < 0.55 or not convs:
            convs.append([next(next_id) for _ in range(rng.randint(1, 3))])
            chains.append(list(convs[-1]))
        elif r < 0.75:
            conv = rng.choice(convs[-6:])
            conv += [next(next_id) for _ in range(rng.randint(1, 2))]
            chains.append(list(conv))
        else:
            chains.append([next(next_id) for _ in range(rng.randint(6, 12))])
    return chains


def drain(policy) -> list[int]:
    order = []
    while len(policy):
        order.append(policy.victim())
        policy.on_remove(order[-1])
    return order


PARAMS = ReuseParams(half_life=300, depth_cost=20, history_floor=16)


@pytest.mark.parametrize("capacity", [40, 120])
def test_same_tokens_same_hits_at_16_and_512(capacity):
    chains = conversation_chains()
    total = sum(map(len, chains))
    coarse = replay(chains, ReuseAwarePolicy(PARAMS, block_tokens=512), capacity) / total
    fine_chains = split_chains(chains, 16)
    fine = replay(fine_chains, ReuseAwarePolicy(PARAMS, block_tokens=16),
                  capacity * 32) / (total * 32)
    assert fine == pytest.approx(coarse, abs=0.003)
    # The test has teeth: LRU is measurably worse here, and parameters read as block
    # operations at 16 tokens (32x too short a half-life) lose the gain.
    lru = replay(chains, LRUPolicy(), capacity) / total
    assert coarse > lru + 0.02
    unscaled = replay(fine_chains, ReuseAwarePolicy(PARAMS, block_tokens=512),
                      capacity * 32) / (total * 32)
    assert abs(unscaled - coarse) > 0.01


def test_eviction_order_in_tokens_matches():
    """Drained to empty, the 16-token policy has dropped whole 512-token units in the
    512-token policy's order: of its first 32k victims, the units it emptied are (almost
    all) the coarse policy's first k."""
    chains = conversation_chains(seed=5, requests=60)
    coarse = ReuseAwarePolicy(PARAMS, block_tokens=512)
    fine = ReuseAwarePolicy(PARAMS, block_tokens=16)
    replay(chains, coarse, 10**6)  # nothing evicted: every block is still tracked
    replay(split_chains(chains, 16), fine, 10**6)
    order_coarse = drain(coarse)
    order_fine = [key // 32 for key in drain(fine)]
    assert sorted(order_coarse) == sorted(set(order_fine))
    n = len(order_coarse)
    for frac, agree in ((0.25, 0.9), (0.5, 0.95), (0.75, 0.95)):
        k = int(frac * n)
        emptied = {u for u, c in Counter(order_fine[:32 * k]).items() if c == 32}
        assert len(emptied & set(order_coarse[:k])) >= agree * k


def test_split_chains_rejects_a_size_that_does_not_divide():
    assert split_chains([[3, 4]], 256) == [[6, 7, 8, 9]]
    with pytest.raises(ValueError):
        split_chains([[1]], 24)


def test_pool_policy_uses_the_engine_block_size():
    policy = PoolSettings(policy="reuse_aware", block_tokens=16).make_policy()
    assert isinstance(policy, ReuseAwarePolicy) and policy.block_tokens == 16
    assert isinstance(PoolSettings(policy="lru").make_policy(), LRUPolicy)
    with pytest.raises(ValueError):
        PoolSettings(block_tokens=0)
    with pytest.raises(ValueError):
        ReuseAwarePolicy(block_tokens=0)
