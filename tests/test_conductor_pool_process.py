"""A real conductor process configured with ``cache_pools`` and a real cache-pool process:
the pool's blocks reach the conductor's prefix index, follow puts and removals, come back
within seconds after a conductor restart, follow a pool restart, and leave the index when
the pool stays away."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from common.pool.client import PoolClient
from common.zmq_auth import make_context
from tests.cluster import Cluster
from tests.pool_procs import PoolProc, blocks

pytestmark = pytest.mark.timeout(90)


def pool_view(cluster: Cluster) -> tuple[int | None, int, dict]:
    """(blocks of location pool:a or None, index_blocks, cache_pools) from the conductor."""
    s = cluster.conductor_stats(1)
    return (s.index_locations.get("pool:a"), s.index_blocks,
            {c.instance_id: c for c in s.cache_pools})


async def until(cluster: Cluster, want, timeout_s: float = 10.0) -> float:
    """Seconds until ``want(pool_view)`` holds; fails with the last view after timeout."""
    start = time.monotonic()
    last = None
    while time.monotonic() - start < timeout_s:
        try:
            last = pool_view(cluster)
            if want(*last):
                return time.monotonic() - start
        except (TimeoutError, KeyError):
            pass
        await asyncio.sleep(0.05)
    raise AssertionError(f"not reached in {timeout_s} s; last view {last}\n"
                         f"{cluster.procs['conductor'].tail()}")


async def test_conductor_index_follows_the_pool_and_rebuilds_after_restarts(tmp_path):
    pool = PoolProc("a", tmp_path).start()
    cluster = Cluster("unused", tmp_path, [], conductor_args=[
        "--cache-pools", pool.control, "--pool-check-interval-s", "0.25",
        "--pool-dead-after-s", "1.5"])
    ctx = make_context(cluster.keys_dir, "decode")  # stores blocks as a worker would
    client = PoolClient(ctx, {"a": pool.control}, timeout_s=5.0)
    try:
        chain = blocks(12, seed=7)
        keys = [k for k, _, _ in chain]
        assert await client.put(chain[:8]) == 8  # held before the conductor exists
        cluster.start_conductor()
        await until(cluster, lambda n, total, pools: n == 8 and total == 8
                    and pools["a"].synced and pools["a"].blocks == 8)
        assert await client.put(chain[8:]) == 4
        await until(cluster, lambda n, total, pools: n == 12 and total == 12)
        assert await client.remove(keys[:3]) == 3
        await until(cluster, lambda n, total, pools: n == 9 and total == 9)

        # A new conductor starts empty and resyncs the pool within seconds.
        cluster.signal("conductor", signal.SIGKILL)
        cluster.procs["conductor"].popen.wait(10)
        cluster.start_conductor()
        took = await until(cluster, lambda n, total, pools: n == 9 and total == 9)
        assert took < 5.0, f"pool part of the index rebuilt after {took:.1f} s"

        # The pool is killed (DRAM only: it comes back empty) and restarted.
        pool.stop(signal.SIGKILL)
        pool.start()
        await until(cluster, lambda n, total, pools: n == 0 and total == 0)
        fresh = blocks(2, seed=8)
        assert await client.put(fresh) == 2
        await until(cluster, lambda n, total, pools: n == 2 and total == 2)

        # Gone for good: after pool_dead_after_s its location leaves the index.
        pool.stop(signal.SIGKILL)
        await until(cluster, lambda n, total, pools: n is None and total == 0
                    and pools == {})
    finally:
        await client.close()
        ctx.destroy(linger=0)
        cluster.stop()
        pool.stop(signal.SIGKILL)
