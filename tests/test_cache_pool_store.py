"""Storage core of the cache pool: DRAM arena, SSD directory, tiered store, placement."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections import Counter, OrderedDict
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from common.pool import placement
from services.cache_pool.disk_format import BLOCK_HEADER
from services.cache_pool.eviction import LRUPolicy
from services.cache_pool.store import BlockStore
from services.cache_pool.tiers import DramTier, SsdTier

HDR = BLOCK_HEADER.size
ROOT = Path(__file__).resolve().parents[1]


def block(key: int, size: int = 16) -> bytes:
    return random.Random(key).randbytes(size)


def disk_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in (directory / "blocks").rglob("*") if p.is_file())


def block_file(directory: Path, key: int) -> Path:
    return directory / "blocks" / f"{key >> 56:02x}" / f"{key:016x}.blk"


# -- DRAM ---------------------------------------------------------------------------------

def test_dram_random_ops_exact_bytes_lru_order_and_capacity():
    rng = random.Random(1)
    dram = DramTier(capacity_bytes=10 * 64 + 13, policy=LRUPolicy(), block_bytes=64)
    model: OrderedDict[int, bytes] = OrderedDict()  # LRU first
    for _ in range(2000):
        key, op = rng.randrange(40), rng.random()
        if op < 0.5:
            data = model.get(key, rng.randbytes(rng.randint(0, 64)))
            expected = [] if key in model else [k for k in list(model)[:1] if len(model) == 10]
            evicted = dram.put(key, data, depth=rng.randrange(8))
            assert [e.key for e in evicted] == expected
            for e in evicted:
                assert e.data == model.pop(e.key)
            model[key] = data
            model.move_to_end(key)
        elif op < 0.85:
            view = dram.get(key)
            assert (None if view is None else bytes(view)) == model.get(key)
            if key in model:
                model.move_to_end(key)
        else:
            assert dram.remove(key) == (model.pop(key, None) is not None)
        assert dram.used_bytes == sum(map(len, model.values())) <= dram.capacity_bytes
        assert len(dram) == len(model) <= dram.num_slots == 10
        assert sorted(dram.keys()) == sorted(model)


def test_dram_rejects_bad_blocks_unchanged():
    dram = DramTier(256, LRUPolicy(), block_bytes=64)
    dram.put(1, b"a" * 64)
    for key, data, depth, err in [(2, b"x" * 65, 0, ValueError), (-1, b"", 0, ValueError),
                                  (2**64, b"", 0, ValueError), ("k", b"", 0, TypeError),
                                  (2, "text", 0, TypeError), (2, b"", -1, ValueError)]:
        with pytest.raises(err):
            dram.put(key, data, depth)
    assert dram.keys() == [1] and dram.used_bytes == 64
    with pytest.raises(ValueError):
        DramTier(63, LRUPolicy(), block_bytes=64)


# -- SSD ----------------------------------------------------------------------------------

def test_ssd_byte_exact_capacity_never_exceeded(tmp_path):
    rng = random.Random(2)
    cap = 5 * (HDR + 100)
    ssd = SsdTier(tmp_path, cap, LRUPolicy())
    model: dict[int, bytes] = {}
    for _ in range(400):
        key = rng.randrange(2**64) if rng.random() < 0.5 or not model else rng.choice(list(model))
        if rng.random() < 0.6:
            data = model.get(key, rng.randbytes(rng.randint(1, 100)))
            for gone in ssd.put(key, data):
                del model[gone]
            model[key] = data
        else:
            assert ssd.get(key) == model.get(key)
        assert ssd.used_bytes == disk_bytes(tmp_path) <= cap
        assert sorted(ssd.keys()) == sorted(model)
    with pytest.raises(ValueError):
        ssd.put(7, b"x" * cap)
    ssd.close()


def test_ssd_restart_serves_same_bytes_in_recency_order(tmp_path):
    ssd = SsdTier(tmp_path, 10_000, LRUPolicy())
    for key in [5, 2**64 - 1, 9, 0]:
        ssd.put(key, block(key, 200), depth=key % 7)
    assert ssd.get(5) is not None and ssd.remove(9)  # 5 becomes the most recent
    order = [2**64 - 1, 0, 5]
    assert ssd.keys() == order
    # no close(): every record is flushed as it is made, as after a crash
    with SsdTier(tmp_path, 10_000, LRUPolicy()) as again:
        assert again.recovery == (3, 0, 0, "") and again.keys() == order
        assert again.policy.victim() == 2**64 - 1 and again.depth(5) == 5
        assert [again.get(key) for key in order + [9]] == [block(k, 200) for k in order] + [None]
    ssd.close()


def test_ssd_restart_with_smaller_capacity_evicts_to_fit(tmp_path):
    with SsdTier(tmp_path, 10_000, LRUPolicy()) as ssd:
        for key in range(4):
            ssd.put(key, block(key, 100))
    with SsdTier(tmp_path, 2 * (HDR + 100), LRUPolicy()) as small:
        assert small.keys() == [2, 3] and small.used_bytes == disk_bytes(tmp_path)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_ssd_damaged_block_is_a_miss_and_dropped(tmp_path, damage):
    ssd = SsdTier(tmp_path, 10_000, LRUPolicy())
    ssd.put(1, block(1, 100))
    ssd.put(2, block(2, 100))
    path = block_file(tmp_path, 1)
    raw = bytearray(path.read_bytes())
    raw[HDR + 50] ^= 0x01
    {"flip": lambda: path.write_bytes(raw), "truncate": lambda: path.write_bytes(raw[:HDR + 90]),
     "delete": path.unlink}[damage]()
    assert ssd.get(1) is None
    assert not ssd.contains(1) and 1 not in ssd.policy and not path.exists()
    assert ssd.corrupt_dropped == 1 and ssd.used_bytes == HDR + 100
    assert ssd.get(2) == block(2, 100)
    ssd.close()
    with SsdTier(tmp_path, 10_000, LRUPolicy()) as again:
        assert again.keys() == [2]


def test_ssd_garbage_index_starts_empty_with_warning(tmp_path):
    with SsdTier(tmp_path, 10_000, LRUPolicy()) as ssd:
        ssd.put(1, block(1))
    (tmp_path / "index.log").write_bytes(b"PDKVIDX1" + os.urandom(64))
    with capture_logs() as logs:
        ssd = SsdTier(tmp_path, 10_000, LRUPolicy())
    assert any(e["event"] == "ssd_index_discarded" and e["log_level"] == "warning"
               for e in logs)
    assert ssd.recovery.index_discarded and len(ssd) == 0
    assert disk_bytes(tmp_path) == 0  # the unindexed block file was removed
    assert ssd.put(3, block(3)) == [] and ssd.get(3) == block(3)
    ssd.close()


def test_ssd_index_log_bounded_and_torn_tail_ignored(tmp_path):
    with SsdTier(tmp_path, 10_000, LRUPolicy()) as ssd:
        ssd.put(1, block(1))
        ssd.put(2, block(2))
        for i in range(3000):
            ssd.get(1 + i % 2)
        assert (tmp_path / "index.log").stat().st_size < 8 + 32 * 1100
    with open(tmp_path / "index.log", "ab") as f:
        f.write(b"\x01\x00\x00")  # a record cut short by a crash
    with SsdTier(tmp_path, 10_000, LRUPolicy()) as ssd:
        assert ssd.keys() == [1, 2] and ssd.get(2) == block(2)


# -- tiered store -------------------------------------------------------------------------

def make_store(tmp_path, *, ssd_blocks: int | None = 3, events: list | None = None):
    dram = DramTier(2 * 16, LRUPolicy(), block_bytes=16)
    ssd = None if ssd_blocks is None else SsdTier(tmp_path, ssd_blocks * (HDR + 16), LRUPolicy())
    hooks = {}
    if events is not None:
        hooks = {"on_stored": lambda keys: events.append(("stored", keys)),
                 "on_removed": lambda keys: events.append(("removed", keys))}
    return BlockStore(dram, ssd, **hooks)


def test_store_demotes_on_dram_eviction_and_promotes_on_ssd_hit(tmp_path):
    store = make_store(tmp_path)
    store.put_many([(k, block(k), d) for d, k in enumerate([10, 11, 12])])
    assert [store.where(k) for k in (10, 11, 12)] == [("ssd",), ("dram",), ("dram",)]
    assert store.ssd.depth(10) == 0
    assert store.get_many([10, 99]) == [block(10), None]
    assert [store.where(k) for k in (10, 11, 12)] == [("dram", "ssd"), ("ssd",), ("dram",)]
    assert store.get_many([12, 11]) == [block(12), block(11)]
    s = store.stats()
    assert (s.dram_hits, s.ssd_hits, s.misses) == (1, 2, 1)
    # promoting 11 demoted 10 again: SSD still had it, so nothing was written
    assert [store.where(k) for k in (10, 11, 12)] == [("ssd",), ("dram", "ssd"), ("dram",)]
    assert (s.dram_blocks, s.ssd_blocks, s.dram_bytes, s.ssd_bytes) == (2, 2, 32, 2 * (HDR + 16))
    assert s.dram_evictions == 3 and s.ssd_evictions == 0


def test_store_callbacks_fire_exactly_for_stored_and_removed(tmp_path):
    events: list = []
    store = make_store(tmp_path, events=events)  # DRAM 2 blocks, SSD 3, both LRU

    def step(action, expected):
        events.clear()
        action()
        assert events == expected

    step(lambda: store.put_many([(k, block(k), 0) for k in (1, 2, 3)]),
         [("stored", [1, 2, 3])])  # 1 was demoted to SSD: still held, no event
    step(lambda: store.put_many([(k, block(k), 0) for k in (4, 5)]), [("stored", [4, 5])])
    assert (store.dram.keys(), store.ssd.keys()) == ([4, 5], [1, 2, 3])
    # 6 pushes 4 out of DRAM; SSD makes room by evicting 1, in no tier after
    step(lambda: store.put_many([(6, block(6), 0)]), [("stored", [6]), ("removed", [1])])
    # promoting 2 demotes 5, for which SSD evicts 3
    step(lambda: store.get_many([2]), [("removed", [3])])
    assert store.where(2) == ("dram", "ssd")
    step(lambda: store.put_many([(7, block(7), 0)]), [("stored", [7]), ("removed", [4])])
    step(lambda: store.get_many([2]), [])  # a DRAM hit: 2 is now DRAM's newest
    # 8 pushes 7 to SSD, which evicts its oldest, 2; 2 is still in DRAM: not removed
    step(lambda: store.put_many([(8, block(8), 0)]), [("stored", [8])])
    assert store.where(2) == ("dram",)
    step(lambda: store.remove_many([5, 404]), [("removed", [5])])
    step(lambda: store.put_many([(8, block(8), 0)]), [])  # already held: a use


def test_store_without_ssd_removes_on_dram_eviction(tmp_path):
    events: list = []
    store = make_store(tmp_path, ssd_blocks=None, events=events)
    store.put_many([(k, block(k), 0) for k in (1, 2, 3, 4)])
    # 1 and 2 came and went within the call: net, only 3 and 4 were stored
    assert events == [("stored", [3, 4])] and store.stats().dram_evictions == 2


def test_store_corrupt_ssd_block_is_a_removed_miss(tmp_path):
    events: list = []
    store = make_store(tmp_path, events=events)
    store.put_many([(k, block(k), 0) for k in (1, 2, 3)])
    path = block_file(tmp_path, 1)
    path.write_bytes(path.read_bytes()[:-1] + b"?")
    events.clear()
    assert store.get_many([1]) == [None]
    assert events == [("removed", [1])] and store.where(1) == ()
    assert (store.stats().corrupt_dropped, store.stats().misses) == (1, 1)


def test_store_exists_prefix_stops_at_first_missing(tmp_path):
    store = make_store(tmp_path)
    store.put_many([(k, block(k), d) for d, k in enumerate([1, 2, 3])])  # 1 on SSD
    chains = [[1, 2, 3], [1, 2, 9, 3], [9, 1], []]
    assert [store.exists_prefix(chain) for chain in chains] == [3, 2, 0, 0]


def test_store_put_many_validates_before_storing(tmp_path):
    events: list = []
    store = make_store(tmp_path, events=events)
    with pytest.raises(ValueError):
        store.put_many([(1, block(1), 0), (2, b"x" * 17, 1)])
    assert store.where(1) == () and events == []


# -- placement ----------------------------------------------------------------------------

INSTANCES = ["pool-a", "pool-b", "pool-c", "pool-d", "pool-e"]


def test_rendezvous_same_owners_in_another_process():
    keys = [0, 1, 2**63, 2**64 - 1, 123456789]
    code = ("from common.pool.placement import owners; import json; "
            f"print(json.dumps([owners(k, {INSTANCES!r}, 2) for k in {keys!r}]))")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == [placement.owners(k, INSTANCES, 2) for k in keys]
    assert [placement.owner(k, INSTANCES[::-1]) for k in keys] == \
        [placement.owner(k, INSTANCES) for k in keys]


def test_rendezvous_removal_moves_only_the_removed_instances_keys():
    keys = range(10_000)
    before = {k: placement.owner(k, INSTANCES) for k in keys}
    survivors = [i for i in INSTANCES if i != "pool-c"]
    for k in keys:  # the removed instance's keys go to their second choice
        moved = before[k] == "pool-c"
        expected = placement.owners(k, INSTANCES, 2)[1] if moved else before[k]
        assert placement.owner(k, survivors) == expected
    counts = Counter(before.values())
    assert set(counts) == set(INSTANCES)
    assert all(1800 <= n <= 2200 for n in counts.values()), counts


def test_rendezvous_owners_and_errors():
    reps = placement.owners(42, INSTANCES, 3)
    assert len(set(reps)) == 3 and reps[0] == placement.owner(42, INSTANCES)
    for instances, replicas in [([], 1), (["a", "a"], 1), (INSTANCES, 0), (INSTANCES, 6)]:
        with pytest.raises(ValueError):
            placement.owners(1, instances, replicas)
    with pytest.raises(ValueError):
        placement.owner(1, [])
