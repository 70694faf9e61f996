"""The conductor's view of the cache pool: pool events into the prefix index, their order
against a resync, and an in-process pool instance attached, resynced after a restart,
and dropped when silent."""

from __future__ import annotations

import asyncio

import pytest

from common.pool.client import PoolClient
from common.protocol import KVEvent, WorkerInfo
from services.cache_pool.server import CachePool
from services.cache_pool.settings import PoolSettings
from services.conductor.pool_watch import PoolFeed, PoolWatch, reachable
from services.conductor.prefix_index import PrefixIndex
from services.conductor.server import Conductor, ConductorSettings
from tests.cluster import free_port
from tests.pool_procs import BLOCK, blocks

pytestmark = pytest.mark.timeout(60)


def apply_to(index: PrefixIndex):
    """What the conductor's apply_kv_event does to its index."""
    return lambda e: index.apply(e.source, e.kind, e.hashes)


def ev(kind: str, hashes=(), source="pool:a") -> KVEvent:
    return KVEvent(source=source, kind=kind, hashes=list(hashes), tier="dram")


# -- events into the index -------------------------------------------------------------

async def test_conductor_applies_pool_events_next_to_worker_locations():
    conductor = Conductor(ConductorSettings(
        control_addr=f"tcp://127.0.0.1:{free_port()}",
        heartbeat_addr=f"tcp://127.0.0.1:{free_port()}"))
    index, apply = conductor.router.index, conductor.apply_kv_event
    try:
        apply(ev("stored", [1, 2, 3], source="prefill-0"))
        apply(ev("stored", [1, 2, 3, 4]))
        apply(ev("stored", [7], source="pool:b"))
        assert index.counts() == {"pool:a": 4, "pool:b": 1, "prefill-0": 3}
        apply(ev("removed", [2, 99]))
        assert index.match([1, 2, 3]) == {"prefill-0": 3, "pool:a": 1}
        apply(ev("cleared"))
        assert index.counts() == {"pool:b": 1, "prefill-0": 3}
        assert index.match([1, 2, 3]) == {"prefill-0": 3}
        apply(ev("evicted", [7], source="pool:b"))  # an unknown kind changes nothing
        assert index.counts() == {"pool:b": 1, "prefill-0": 3}
        assert conductor.stats().index_locations == {"pool:b": 1, "prefill-0": 3}
    finally:
        await conductor.close()


def test_events_during_a_resync_wait_for_the_snapshot():
    index = PrefixIndex()
    feed = PoolFeed("pool:a", index, apply_to(index))
    feed.event(ev("stored", [1, 2]))
    feed.begin_resync()
    # The pool took its snapshot {1, 2, 3} at T; these came after T but before the reply.
    # Applied at once they would be undone by the older snapshot (3 back, 9 gone).
    assert feed.event(ev("removed", [3]))
    assert feed.event(ev("stored", [9]))
    assert index.counts() == {"pool:a": 2}  # held back
    assert feed.finish_resync([1, 2, 3]) == 2
    assert index.counts() == {"pool:a": 3}
    assert index.match([1, 2, 3]) == {"pool:a": 2} and index.match([9]) == {"pool:a": 1}
    assert feed.synced and not feed.resyncing
    feed.event(ev("removed", [1]))  # applied at once again
    assert index.held("pool:a") == 2


def test_a_starting_pools_cleared_and_announce_around_its_snapshot_end_right():
    index = PrefixIndex()
    feed = PoolFeed("pool:a", index, apply_to(index))
    index.stored("pool:a", [50, 51])  # what a previous boot held: gone now
    feed.begin_resync()
    # Before T: the start's "cleared" and announce, then a put; the snapshot at T has
    # {1, 2, 5}; after T a put and a removal. All arrive before the reply.
    for e in (ev("cleared"), ev("stored", [1, 2]), ev("stored", [5]),
              ev("stored", [6]), ev("removed", [1])):
        feed.event(e)
    feed.finish_resync([1, 2, 5])
    assert sorted(h for h in range(100) if index.match([h])) == [2, 5, 6]
    # The same stream arriving late, after the reply was applied, ends the same.
    index2 = PrefixIndex()
    feed2 = PoolFeed("pool:a", index2, apply_to(index2))
    feed2.begin_resync()
    feed2.finish_resync([1, 2, 5])
    for e in (ev("cleared"), ev("stored", [1, 2]), ev("stored", [5]),
              ev("stored", [6]), ev("removed", [1])):
        feed2.event(e)
    assert index2.counts() == index.counts() == {"pool:a": 3}


def test_failed_resync_applies_held_events_and_stays_unsynced():
    index = PrefixIndex()
    feed = PoolFeed("pool:a", index, apply_to(index))
    feed.begin_resync()
    feed.event(ev("stored", [4, 5]))
    assert not feed.event(ev("stored", [8], source="pool:other"))  # not this feed's
    feed.abort_resync()
    assert index.counts() == {"pool:a": 2} and not feed.synced and not feed.resyncing


def test_wildcard_events_host_becomes_the_control_host():
    assert reachable("tcp://0.0.0.0:5581", "tcp://10.0.0.7:5580") == "tcp://10.0.0.7:5581"
    assert reachable("tcp://*:5581", "tcp://pool-host:5580") == "tcp://pool-host:5581"
    assert reachable("tcp://[::]:5581", "tcp://[fd00::7]:5580") == "tcp://[fd00::7]:5581"
    assert reachable("tcp://127.0.0.1:5581", "tcp://10.0.0.7:5580") == "tcp://127.0.0.1:5581"
    assert reachable("ipc:///tmp/ev", "tcp://10.0.0.7:5580") == "ipc:///tmp/ev"


def test_conductor_settings_check_the_pool_timings():
    with pytest.raises(ValueError, match="pool_dead_after_s"):
        ConductorSettings(pool_dead_after_s=0)
    assert ConductorSettings().cache_pools == ""


# -- an in-process pool instance, real sockets -----------------------------------------

class Pool:
    """A CachePool in this event loop that can be stopped and started on its addresses."""

    def __init__(self, instance_id: str = "a") -> None:
        self.settings = PoolSettings(
            instance_id=instance_id, control_addr=f"tcp://127.0.0.1:{free_port()}",
            events_addr=f"tcp://127.0.0.1:{free_port()}", dram_mib=64 * BLOCK / (1 << 20),
            block_bytes=BLOCK, log_format="console")
        self.pool: CachePool | None = None

    async def start(self) -> CachePool:
        self.pool = CachePool(self.settings)
        await self.pool.start()
        return self.pool

    async def stop(self) -> None:
        if self.pool is not None:
            await self.pool.close()
            self.pool = None


async def until(pred, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not pred():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def test_watch_attaches_follows_resyncs_a_restart_and_drops_the_silent(ctx):
    pool = Pool()
    await pool.start()
    index = PrefixIndex()
    watch = PoolWatch(ctx, [pool.settings.control_addr], index, apply_to(index),
                      check_interval_s=0.2, dead_after_s=1.0)
    client = PoolClient(ctx, {"a": pool.settings.control_addr}, timeout_s=2.0)
    try:
        chain = blocks(10, seed=1)
        keys = [k for k, _, _ in chain]
        assert await client.put(chain[:6]) == 6
        await watch.check()  # attach: subscribe, then resync
        assert index.counts() == {"pool:a": 6}
        [a] = watch.stats()
        assert a.instance_id == "a" and a.synced and a.blocks == 6
        assert await client.put(chain[6:]) == 4  # followed through the events
        await until(lambda: index.held("pool:a") == 10)
        assert await client.remove(keys[:2]) == 2
        await until(lambda: index.held("pool:a") == 8)
        assert index.match(keys[2:]) == {"pool:a": 8}

        # A restart that lost everything, checked before its announce could arrive:
        # the new boot id alone makes the watch resync.
        await pool.stop()
        await pool.start()
        other = blocks(3, seed=2)
        assert await client.put(other) == 3
        await watch.check()
        assert index.counts() == {"pool:a": 3}
        assert index.match([k for k, _, _ in other]) == {"pool:a": 3}
        await asyncio.sleep(0.7)  # its announce (cleared + stored) changes nothing
        await watch.check()
        assert index.counts() == {"pool:a": 3}

        # Silent past dead_after_s: its blocks leave the index; back: attached afresh.
        await pool.stop()
        await watch.check()
        assert index.held("pool:a") == 3  # silent, not yet for long
        await asyncio.sleep(1.1)
        await watch.check()
        assert index.counts() == {} and watch.stats() == []
        await pool.start()
        await watch.check()
        assert watch.stats()[0].synced and index.held("pool:a") == 0
        assert await client.put(other) == 3  # followed again
        await until(lambda: index.counts() == {"pool:a": 3})
    finally:
        await client.close()
        await watch.close()
        await pool.stop()


async def test_watch_keeps_retrying_an_instance_that_is_not_up_yet(ctx):
    pool = Pool()
    index = PrefixIndex()
    watch = PoolWatch(ctx, [pool.settings.control_addr], index, apply_to(index),
                      check_interval_s=0.1)
    task = asyncio.create_task(watch.run())
    try:
        await asyncio.sleep(0.5)
        assert watch.stats() == []
        await pool.start()
        client = PoolClient(ctx, {"a": pool.settings.control_addr})
        await client.put(blocks(4, seed=3))
        await client.close()
        await until(lambda: index.held("pool:a") == 4)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await watch.close()
        await pool.stop()


async def test_live_conductor_routes_on_blocks_spread_over_two_pool_instances(ctx, tmp_path):
    from common.cost_profile import CostProfile, save_profile
    from common.protocol import Hello, Route
    from common.zmq_rpc import RpcClient

    # prefill(n, c) = 0.05 + 1e-3 n + 1e-6 n (n/2 + c); 64-token blocks of 64 KB
    profile = save_profile(CostProfile(
        "t", 0.05, 1e-3, 1e-6, 0.01, 1e-3, 1e-5, kv_bytes_per_token=1000, block_size=64,
        link_bandwidth=1e9, pool_bandwidth=1e8), tmp_path / "t.json")
    pools = [Pool("x"), Pool("y")]
    for pool in pools:
        await pool.start()
    conductor = Conductor(ConductorSettings(
        control_addr=f"tcp://127.0.0.1:{free_port()}",
        heartbeat_addr=f"tcp://127.0.0.1:{free_port()}", heartbeat_interval_s=60.0,
        cost_profile=str(profile), pool_check_interval_s=0.1,
        cache_pools=",".join(p.settings.control_addr for p in pools)))
    await conductor.start()
    rpc = RpcClient(ctx, conductor.rpc.address, name="test")
    client = PoolClient(ctx, {p.settings.instance_id: p.settings.control_addr for p in pools})
    try:
        for wid, role in (("decode-0", "decode"), ("prefill-0", "prefill")):
            await rpc.call(Hello(info=WorkerInfo(
                worker_id=wid, role=role, model="sim", control_addr=f"tcp://{wid}:1",
                kv_addr=f"tcp://{wid}:2", host_id=wid, block_size=64, num_blocks=1000,
                fingerprint="fp")))
        chain = blocks(16, seed=5)
        keys = [k for k, _, _ in chain]
        assert await client.put(chain[:12]) == 12
        index = conductor.router.index
        await until(lambda: sum(index.counts().values()) == 12)
        held = index.counts()
        assert set(held) == {"pool:x", "pool:y"} and min(held.values()) > 0  # spread
        assert {c.instance_id for c in conductor.stats().cache_pools} == {"x", "y"}
        reply = (await rpc.call(Route(model="sim", prompt_len=16 * 64,
                                      block_hashes=keys))).record
        assert "hit 12/16" in reply.reason
    finally:
        await client.close()
        await rpc.close()
        await conductor.close()
        for pool in pools:
            await pool.stop()
