"""BlockManager: exact block ids, eviction order, ref counts, and prefix-cache confirmation."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from common.block_hash import hash_blocks
from services.engine.block_manager import BlockManager, NoFreeBlocksError

BS = 2
FP = "test-model"


class Events:
    """Records what the manager reports through its callbacks."""

    def __init__(self) -> None:
        self.stored: list[list[int]] = []
        self.removed: list[list[int]] = []


@pytest.fixture
def make_manager():
    """Build block managers and check every one of them is consistent when the test ends."""
    managers: list[BlockManager] = []

    def make(num_blocks: int, events: Events | None = None, **kwargs) -> BlockManager:
        if events is not None:
            kwargs.update(on_stored=events.stored.append, on_removed=events.removed.append)
        manager = BlockManager(num_blocks, BS, **kwargs)
        managers.append(manager)
        return manager

    yield make
    for manager in managers:
        manager.check_invariants()


def blocks_of(tokens: list[int]) -> list[list[int]]:
    return [tokens[i : i + BS] for i in range(0, len(tokens) - BS + 1, BS)]


def cache_sequence(manager: BlockManager, tokens: list[int]) -> tuple[list[int], list[int]]:
    """Allocate and cache one sequence's full blocks; return (block ids, hashes)."""
    hashes = hash_blocks(tokens, BS, FP)
    ids = manager.allocate(len(hashes))
    for block_id, block_hash, block in zip(ids, hashes, blocks_of(tokens), strict=True):
        manager.cache_block(block_id, block_hash, block)
    return ids, hashes


def test_allocate_returns_ascending_ids_from_zero(make_manager):
    manager = make_manager(8)
    assert manager.allocate(3) == [0, 1, 2]
    assert manager.allocate(2) == [3, 4]
    assert manager.allocate(0) == []
    assert (manager.num_free_blocks, manager.num_used_blocks) == (3, 5)
    assert [manager.ref_count(b) for b in range(8)] == [1, 1, 1, 1, 1, 0, 0, 0]
    manager.free([4, 3, 2, 1, 0])
    assert manager.num_free_blocks == 8


def test_plain_blocks_rejoin_tail_in_given_order(make_manager):
    manager = make_manager(4)
    assert manager.allocate(2) == [0, 1]
    manager.free([1, 0])
    assert manager.allocate(4) == [2, 3, 1, 0]
    manager.free([0, 1, 2, 3])


def test_eviction_is_lru_and_tail_first_when_freed_reversed(make_manager):
    events = Events()
    manager = make_manager(6, events)
    tokens = [11, 12, 13, 14, 15, 16]
    ids, hashes = cache_sequence(manager, tokens)
    assert ids == [0, 1, 2]
    assert events.stored == [[hashes[0]], [hashes[1]], [hashes[2]]]
    manager.free(list(reversed(ids)))
    assert manager.num_free_blocks == 6

    # Never-used blocks go first; nothing is evicted for them.
    assert manager.allocate(3) == [3, 4, 5]
    assert events.removed == []
    # Matching does not reorder the LRU queue.
    assert manager.match_prefix(hashes, blocks_of(tokens)) == [0, 1, 2]

    assert manager.allocate(1) == [2]
    assert events.removed == [[hashes[2]]]
    assert manager.block_hash(2) is None
    assert manager.block_hash(1) == hashes[1]
    assert manager.match_prefix(hashes, blocks_of(tokens)) == [0, 1]

    assert manager.allocate(2) == [1, 0]
    assert events.removed == [[hashes[2]], [hashes[1], hashes[0]]]
    assert manager.match_prefix(hashes, blocks_of(tokens)) == []
    manager.free([0, 1, 2, 3, 4, 5])
    assert manager.num_free_blocks == 6


def test_plain_free_blocks_are_reused_before_evicting_cached(make_manager):
    events = Events()
    manager = make_manager(4, events)
    assert manager.allocate(4) == [0, 1, 2, 3]
    manager.cache_block(0, 100, [1, 2])
    manager.cache_block(1, 101, [3, 4])
    manager.free([0, 1, 2, 3])
    assert manager.allocate(2) == [2, 3]
    assert events.removed == []
    assert manager.allocate(1) == [0]
    assert events.removed == [[100]]
    manager.free([0, 2, 3])


def test_shared_block_refs_through_acquire_and_free(make_manager):
    manager = make_manager(4)
    tokens = [1, 2, 3, 4]
    ids, hashes = cache_sequence(manager, tokens)
    manager.free(list(reversed(ids)))  # LRU queue: [1, 0]
    assert [manager.ref_count(b) for b in ids] == [0, 0]

    hits = manager.match_prefix(hashes, blocks_of(tokens))
    assert hits == [0, 1]
    assert manager.ref_count(0) == 0  # matching takes no reference
    manager.acquire(hits)
    assert [manager.ref_count(b) for b in ids] == [1, 1]
    assert manager.num_free_blocks == 2
    manager.acquire(hits[:1])  # a second sequence shares block 0
    assert [manager.ref_count(b) for b in ids] == [2, 1]

    manager.free([1, 0])  # first sequence finishes: block 1 rejoins the LRU tail
    assert [manager.ref_count(b) for b in ids] == [1, 0]
    assert manager.num_free_blocks == 3
    manager.free([0])
    assert manager.num_free_blocks == 4
    # LRU queue is now [1, 0]; the never-used blocks 2 and 3 go first.
    assert manager.allocate(4) == [2, 3, 1, 0]
    manager.free([0, 1, 2, 3])


def test_double_free_raises_and_changes_nothing(make_manager):
    manager = make_manager(4)
    assert manager.allocate(2) == [0, 1]
    with pytest.raises(ValueError, match="double free"):
        manager.free([1, 0, 0])
    assert [manager.ref_count(b) for b in range(4)] == [1, 1, 0, 0]
    manager.free([0])
    with pytest.raises(ValueError, match="double free"):
        manager.free([0])
    with pytest.raises(ValueError, match="double free"):
        manager.free([3])
    with pytest.raises(ValueError):
        manager.free([4])
    assert manager.num_free_blocks == 3
    manager.free([1])


def test_no_free_blocks_leaves_state_unchanged(make_manager):
    events = Events()
    manager = make_manager(4, events)
    tokens = [5, 6, 7, 8]
    ids, hashes = cache_sequence(manager, tokens)
    manager.free(list(reversed(ids)))
    assert manager.allocate(1) == [2]
    with pytest.raises(NoFreeBlocksError):
        manager.allocate(4)
    assert manager.num_free_blocks == 3
    assert [manager.block_hash(b) for b in range(4)] == [hashes[0], hashes[1], None, None]
    assert events.removed == []
    assert manager.match_prefix(hashes, blocks_of(tokens)) == [0, 1]
    assert manager.allocate(3) == [3, 1, 0]
    manager.free([0, 1, 2, 3])
    with pytest.raises(ValueError):
        manager.allocate(-1)


def test_match_prefix_stops_at_first_miss(make_manager):
    manager = make_manager(8)
    tokens = [1, 2, 3, 4, 5, 6]
    ids, hashes = cache_sequence(manager, tokens)
    assert manager.match_prefix(hashes, blocks_of(tokens)) == ids
    assert manager.match_prefix([hashes[0], 12345, hashes[2]], blocks_of(tokens)) == [0]
    assert manager.match_prefix([], []) == []
    changed = [1, 2, 9, 4, 5, 6]  # block 1 differs, so its hash and all later ones do
    assert manager.match_prefix(hash_blocks(changed, BS, FP), blocks_of(changed)) == [0]
    with pytest.raises(ValueError):
        manager.match_prefix(hashes, blocks_of(tokens)[:2])
    manager.free(list(reversed(ids)))


def test_match_prefix_rejects_a_hash_collision(make_manager):
    manager = make_manager(4)
    (block,) = manager.allocate(1)
    manager.cache_block(block, 0xC0FFEE, [7, 7])
    assert manager.match_prefix([0xC0FFEE], [[7, 8]]) == []
    assert manager.match_prefix([0xC0FFEE], [(7, 7)]) == [block]
    manager.free([block])
    assert manager.match_prefix([0xC0FFEE], [[7, 8]]) == []
    assert manager.match_prefix([0xC0FFEE], [[7, 7]]) == [block]


def test_cache_block_keeps_first_holder_of_a_hash(make_manager):
    events = Events()
    manager = make_manager(4, events)
    assert manager.allocate(2) == [0, 1]
    manager.cache_block(0, 42, [1, 2])
    manager.cache_block(0, 42, [1, 2])  # idempotent
    manager.cache_block(1, 42, [1, 2])  # same content elsewhere: block 1 stays uncached
    assert (manager.block_hash(0), manager.block_hash(1)) == (42, None)
    assert events.stored == [[42]]
    assert manager.match_prefix([42], [[1, 2]]) == [0]
    manager.free([1, 0])
    # Block 1 went back as plain, block 0 as cached.
    assert manager.allocate(3) == [2, 3, 1]
    manager.free([1, 2, 3])


def test_cache_block_rejects_misuse(make_manager):
    manager = make_manager(4)
    assert manager.allocate(1) == [0]
    with pytest.raises(ValueError):
        manager.cache_block(0, 1, [1])  # not a full block
    with pytest.raises(ValueError):
        manager.cache_block(1, 1, [1, 2])  # free block
    manager.cache_block(0, 1, [1, 2])
    with pytest.raises(ValueError):
        manager.cache_block(0, 2, [1, 2])  # already cached under another hash
    with pytest.raises(ValueError):
        manager.cache_block(0, 1, [1, 3])  # same hash, other tokens
    assert manager.block_hash(0) == 1
    manager.free([0])


def test_acquire_refuses_plain_free_block(make_manager):
    manager = make_manager(4)
    assert manager.allocate(1) == [0]
    manager.free([0])
    with pytest.raises(ValueError, match="uncached"):
        manager.acquire([0])
    assert manager.ref_count(0) == 0
    assert manager.num_free_blocks == 4


def test_reset_prefix_cache_drops_only_free_hashes(make_manager):
    events = Events()
    manager = make_manager(4, events)
    ids, hashes = cache_sequence(manager, [1, 2, 3, 4, 5, 6])
    assert ids == [0, 1, 2]
    manager.free([2, 1])  # block 0 stays in use
    assert manager.reset_prefix_cache() == 2
    assert events.removed == [[hashes[2], hashes[1]]]
    assert [manager.block_hash(b) for b in range(3)] == [hashes[0], None, None]
    assert manager.reset_prefix_cache() == 0
    assert events.removed == [[hashes[2], hashes[1]]]
    # The dropped blocks rejoined the plain queue after block 3, in LRU order.
    assert manager.allocate(3) == [3, 2, 1]
    manager.free([0, 1, 2, 3])


def test_prefix_caching_disabled_never_matches(make_manager):
    events = Events()
    manager = make_manager(4, events, enable_prefix_caching=False)
    tokens = [1, 2, 3, 4]
    hashes = hash_blocks(tokens, BS, FP)
    ids = manager.allocate(2)
    for block_id, block_hash, block in zip(ids, hashes, blocks_of(tokens), strict=True):
        manager.cache_block(block_id, block_hash, block)
    assert [manager.block_hash(b) for b in ids] == [None, None]
    assert events.stored == []
    assert manager.match_prefix(hashes, blocks_of(tokens)) == []
    manager.free(list(reversed(ids)))
    assert manager.match_prefix(hashes, blocks_of(tokens)) == []
    assert manager.allocate(4) == [2, 3, 1, 0]
    assert events.removed == []
    manager.free([0, 1, 2, 3])


def test_constructor_validates_sizes():
    with pytest.raises(ValueError):
        BlockManager(0, 16)
    with pytest.raises(ValueError):
        BlockManager(4, 0)


def test_check_invariants_detects_corruption(make_manager):
    manager = make_manager(4)
    manager.check_invariants()
    broken = BlockManager(4, BS)
    broken._refs[0] = 1  # used by ref count, yet still in the free queue
    with pytest.raises(RuntimeError, match="free queues"):
        broken.check_invariants()
    broken = BlockManager(4, BS)
    broken.allocate(1)
    broken.cache_block(0, 9, [1, 2])
    broken._block_by_hash.clear()
    with pytest.raises(RuntimeError, match="map back"):
        broken.check_invariants()


def test_randomized_operations_keep_invariants(make_manager):
    rng = random.Random(1234)
    events = Events()
    manager = make_manager(16, events)
    held: list[list[int]] = []  # block tables of live sequences
    for _ in range(400):
        op = rng.choice(["new", "new", "free", "free", "reset"] if held else ["new"])
        if op == "new":
            tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 4) * BS)]
            hashes = hash_blocks(tokens, BS, FP)
            hits = manager.match_prefix(hashes, blocks_of(tokens))
            manager.acquire(hits)
            need = len(hashes) - len(hits)
            try:
                fresh = manager.allocate(need)
            except NoFreeBlocksError:
                manager.free(list(reversed(hits)))
                fresh = None
            if fresh is not None:
                table = hits + fresh
                for i in range(len(hits), len(table)):
                    manager.cache_block(table[i], hashes[i], blocks_of(tokens)[i])
                held.append(table)
        elif op == "free":
            table = held.pop(rng.randrange(len(held)))
            manager.free(list(reversed(table)))
        else:
            manager.reset_prefix_cache()
        manager.check_invariants()
        expected = Counter(b for table in held for b in table)
        assert [manager.ref_count(b) for b in range(16)] == [expected[b] for b in range(16)]
    assert events.stored and events.removed  # the run exercised caching and eviction
    for table in held:
        manager.free(list(reversed(table)))
    manager.check_invariants()
    assert manager.num_free_blocks == manager.num_blocks
    assert manager.num_used_blocks == 0


def test_match_prefix_is_a_result_and_allocating_takes_it():
    from common.sampling_params import SamplingParams
    from services.engine.kv_manager import KVCacheManager
    from services.engine.sampling_state import SamplingState
    from services.engine.sequence import Sequence

    def seq(rid: str, tokens: list[int]) -> Sequence:
        state = SamplingState.create(SamplingParams(), tokens, seeded_generator=False)
        return Sequence(rid, tokens, state)

    manager = BlockManager(4, BS)
    kv = KVCacheManager(manager, FP)
    tokens = [1, 2, 3, 4, 5]
    first = seq("a", tokens)
    assert kv.allocate_slots(first, 5)
    first.num_computed_tokens = 5
    kv.cache_full_blocks(first)
    kv.free(first)
    again = seq("b", tokens)
    match = kv.match_prefix(again)
    assert match.block_ids == [0, 1] and match.block_hashes == hash_blocks(tokens[:4], BS, FP)
    assert again.block_table == [] and again.block_hashes == []  # matching changed nothing
    assert [manager.ref_count(b) for b in range(4)] == [0, 0, 0, 0]
    assert not kv.allocate_slots(again, 1 + 2 * BS, match)  # 3 new blocks: only 2 spare
    assert again.block_table == [] and again.block_hashes == []  # nothing to undo
    assert kv.allocate_slots(again, 1, match)
    assert again.block_table[:2] == [0, 1] and again.block_hashes == match.block_hashes
    assert again.num_computed_tokens == 2 * BS
    kv.free(again)
    manager.check_invariants()
