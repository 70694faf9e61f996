"""The cache-pool process, run as real subprocesses, through PoolClient and raw sockets."""

from __future__ import annotations

import asyncio
import signal
import urllib.request

import msgpack
import pytest
import zmq
import zmq.asyncio
from structlog.testing import capture_logs

from common import protocol as p
from common.pool import placement
from common.pool.client import PoolClient
from common.zmq_io import Subscriber
from common.zmq_rpc import RemoteError, RpcClient
from tests.cluster import free_port
from tests.pool_procs import BLOCK, PoolProc, blocks

pytestmark = pytest.mark.timeout(60)


async def exists(ctx, proc: PoolProc, keys: list[int]) -> tuple[int, list[str]]:
    client = RpcClient(ctx, proc.control, name="test")
    try:
        reply = (await client.call(p.PoolExists(keys=keys))).record
        return reply.found, reply.tiers
    finally:
        await client.close()


async def next_event(sub: Subscriber) -> p.KVEvent:
    return (await asyncio.wait_for(sub.recv(), 5.0)).record


async def test_put_get_exists_remove_byte_exact(ctx, pools):
    port = free_port()
    pool = pools(extra=["--metrics-port", str(port)]).start()
    client = PoolClient(ctx, {"a": pool.control})
    chain = blocks(20)
    keys = [k for k, _, _ in chain]
    assert await client.put(chain) == 20
    assert await client.get(keys) == [d for _, d, _ in chain]
    assert await client.get(keys[:7] + [12345] + keys[8:]) == [d for _, d, _ in chain[:7]]
    assert await client.exists(keys) == 20
    assert await exists(ctx, pool, keys[:3]) == (3, ["dram"] * 3)
    assert await client.remove(keys[10:12] + [999]) == 2
    assert await client.exists(keys) == 10
    assert await client.get(keys) == [d for _, d, _ in chain[:10]]
    rpc = RpcClient(ctx, pool.control, name="test")  # Ack detail: blocks new to the pool
    reply = await rpc.call(p.PoolPut(keys=keys[9:12], depths=[9, 10, 11], block_bytes=BLOCK),
                           bulk=[d for _, d, _ in chain[9:12]])
    assert reply.record == p.Ack(detail="2")
    await rpc.close()
    stats = pool.stats()
    assert (stats.dram_blocks, stats.dram_hits, stats.misses) == (20, 20 + 7 + 10, 2)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    assert 'pdserve:cache_pool_hits_total{tier="dram"} 37.0' in text
    assert f'pdserve:cache_pool_bytes{{tier="dram"}} {20 * BLOCK}.0' in text
    assert 'pdserve:cache_pool_requests_total{outcome="ok",type="pool_put"} 2.0' in text
    await client.close()


async def test_capacity_and_exact_lru_order_across_tiers(ctx, pools):
    pool = pools(dram_blocks=4, ssd_blocks=6).start()
    client = PoolClient(ctx, {"a": pool.control})
    chain = blocks(12)
    keys = [k for k, _, _ in chain]
    for item in chain:  # one put each, so the LRU order is the put order
        assert await client.put([item]) == 1
        stats = pool.stats()
        assert stats.dram_bytes <= 4 * BLOCK and stats.ssd_bytes <= 6 * (BLOCK + 32)
    tiers = {k: (await exists(ctx, pool, [k]))[1] for k in keys}
    assert [tiers[k] for k in keys] == [[]] * 2 + [["ssd"]] * 6 + [["dram"]] * 4
    # A hit on k2 (SSD) promotes it: DRAM demotes its LRU k8; SSD, full, drops its LRU k3
    # (k2 was just touched there).
    assert await client.get([keys[2]]) == [chain[2][1]]
    tiers = {k: (await exists(ctx, pool, [k]))[1] for k in keys}
    assert [i for i, k in enumerate(keys) if tiers[k] == ["dram"]] == [2, 9, 10, 11]
    assert [i for i, k in enumerate(keys) if tiers[k] == ["ssd"]] == [4, 5, 6, 7, 8]
    assert tiers[keys[3]] == []
    many = blocks(200, seed=1)
    for i in range(0, 200, 25):
        assert await client.put(many[i:i + 25]) == 25
    stats = pool.stats()
    assert (stats.dram_blocks, stats.ssd_blocks) == (4, 6)
    assert stats.dram_bytes == 4 * BLOCK and stats.ssd_bytes == 6 * (BLOCK + 32)
    assert await client.get([k for k, _, _ in many[-4:]]) == [d for _, d, _ in many[-4:]]
    await client.close()


async def test_events_and_resync(ctx, pools):
    pool = pools(dram_blocks=4)
    sub = Subscriber(ctx, pool.events, bind=False, topics=[b"kv"])  # before the bind
    pool.start()
    assert await next_event(sub) == p.KVEvent(source="pool:a", kind="cleared", hashes=[])
    client = PoolClient(ctx, {"a": pool.control})
    chain = blocks(6)
    keys = [k for k, _, _ in chain]
    await client.put(chain[:3])
    assert await next_event(sub) == p.KVEvent("pool:a", "stored", keys[:3], "dram")
    await client.put(chain[3:])  # DRAM holds 4 and there is no SSD: k0, k1 are dropped
    assert await next_event(sub) == p.KVEvent("pool:a", "stored", keys[3:], "dram")
    assert await next_event(sub) == p.KVEvent("pool:a", "removed", keys[:2], "")
    rpc = RpcClient(ctx, pool.control, name="test")
    held = (await rpc.call(p.Resync())).record
    assert held.source == "pool:a"
    assert sorted(held.hashes) == sorted(keys[2:]) and held.tiers == ["dram"] * 4
    await client.remove([keys[4]])
    assert await next_event(sub) == p.KVEvent("pool:a", "removed", [keys[4]], "")
    held = (await rpc.call(p.Resync())).record
    assert sorted(held.hashes) == sorted(keys[2:4] + keys[5:])
    await rpc.close()
    await sub.close()
    await client.close()


async def test_restart_serves_the_same_bytes_and_corrupt_files_are_misses(ctx, pools):
    pool = pools(dram_blocks=4, ssd_blocks=16).start()
    client = PoolClient(ctx, {"a": pool.control}, timeout_s=2.0)
    chain = blocks(10)
    keys, data = [k for k, _, _ in chain], [d for _, d, _ in chain]
    assert await client.put(chain) == 10  # 6 demoted to SSD, 4 flushed there on SIGTERM
    assert pool.stop() == 0
    pool.start(learn_block_bytes=True)
    assert pool.stats().block_bytes == BLOCK  # learned from the blocks on SSD
    assert await exists(ctx, pool, keys) == (10, ["ssd"] * 10)
    assert await client.get(keys) == data
    assert pool.stop() == 0
    raw = bytearray(pool.block_file(keys[5]).read_bytes())
    raw[-1] ^= 0xFF  # a flipped payload bit passes recovery, fails the checksum on read
    pool.block_file(keys[5]).write_bytes(bytes(raw))
    with pool.block_file(keys[7]).open("r+b") as f:  # truncated: dropped at recovery
        f.truncate(100)
    pool.start()
    assert await exists(ctx, pool, keys) == (7, ["ssd"] * 7)
    assert await client.get(keys) == data[:5]
    assert await client.exists(keys) == 5
    assert await client.get(keys[6:]) == [data[6]]
    assert pool.stats().corrupt_dropped == 1
    assert not pool.block_file(keys[5]).exists() and not pool.block_file(keys[7]).exists()
    await client.close()


async def test_two_instances_placement_and_a_dead_one(ctx, pools):
    a, b = pools("a").start(), pools("b").start()
    addrs = {"a": a.control, "b": b.control}
    client = PoolClient(ctx, addrs, timeout_s=0.5, down_retry_s=30)
    mirrored = PoolClient(ctx, addrs, replicas=2, timeout_s=0.5)
    chain, copies = blocks(40), blocks(10, seed=7)
    keys, data = [k for k, _, _ in chain], [d for _, d, _ in chain]
    assert await client.put(chain) == 40
    assert await mirrored.put(copies) == 10
    for proc in (a, b):
        mine = [k for k in keys if placement.owner(k, ["a", "b"]) == proc.instance]
        assert 0 < len(mine) < 40
        for k in keys:
            assert (await exists(ctx, proc, [k]))[0] == (k in mine)
        assert proc.stats().dram_blocks == len(mine) + 10
    first_b = next(i for i, k in enumerate(keys) if placement.owner(k, ["a", "b"]) == "b")
    b.stop(signal.SIGKILL)
    with capture_logs() as logs:
        assert await client.get(keys) == data[:first_b]
        assert await client.exists(keys) == first_b
        assert await client.get(keys) == data[:first_b]  # skipped at once: marked down
        owned_by_a = sum(placement.owner(k, ["a", "b"]) == "a" for k, _, _ in blocks(30, 3))
        assert await client.put(blocks(30, 3)) == owned_by_a
    assert [e["event"] for e in logs].count("pool_instance_down") == 1
    assert await mirrored.get([k for k, _, _ in copies]) == [d for _, d, _ in copies]
    await client.close()
    await mirrored.close()


def _raw_call(addr: str, frames: list[bytes]) -> p.Message:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    try:
        sock.send_multipart(frames)
        assert sock.poll(5000), "no reply"
        return p.decode(sock.recv_multipart())
    finally:
        sock.close()


async def test_bad_requests_are_answered_and_the_pool_keeps_serving(ctx, pools):
    pool = pools(extra=["--max-request-bytes", str(8 * BLOCK)]).start(learn_block_bytes=True)
    rpc = RpcClient(ctx, pool.control, name="test")
    [(k0, d0, _)] = blocks(1)
    bad = [
        (p.PoolPut(keys=[k0, 1], depths=[0], block_bytes=BLOCK), [d0, d0]),
        (p.PoolPut(keys=[k0], depths=[0], block_bytes=BLOCK), [d0[:-1]]),
        (p.PoolPut(keys=[k0], depths=[0], block_bytes=0), [b""]),
        (p.PoolPut(keys=[-1], depths=[0], block_bytes=BLOCK), [d0]),
        (p.PoolPut(keys=[k0], depths=[-2], block_bytes=BLOCK), [d0]),
        (p.PoolPut(keys=[k0] * 9, depths=[0] * 9, block_bytes=BLOCK), [d0] * 9),
        (p.PoolGet(keys=[k0]), [b"unexpected"]),
        (p.PoolExists(keys=[2**63, -5]), []),
    ]
    for record, bulk in bad:
        with pytest.raises(RemoteError) as info:
            await rpc.call(record, bulk=bulk)
        assert info.value.code == "bad_request", record
    assert pool.stats().block_bytes == 0  # nothing was learned from refused puts
    assert (await rpc.call(p.PoolPut(keys=[k0], depths=[0], block_bytes=BLOCK),
                           bulk=[d0])).record == p.Ack(detail="1")
    for record, bulk in [(p.PoolPut(keys=[1], depths=[0], block_bytes=BLOCK // 2),
                          [d0[:BLOCK // 2]]), (p.PoolGet(keys=[k0] * 9), [])]:
        with pytest.raises(RemoteError, match="bad_request"):
            await rpc.call(record, bulk=bulk)
    with pytest.raises(RemoteError, match="unsupported"):
        await rpc.call(p.Ack())
    assert _raw_call(pool.control, [b"\xc1"]).record.code == "malformed"
    head = {"v": p.PROTOCOL_VERSION, "type": "teleport", "id": "x", "body": {}}
    assert _raw_call(pool.control, [msgpack.packb(head)]).record.code == "unknown_type"
    head = {"v": p.PROTOCOL_VERSION, "type": "pool_get", "id": "y", "body": {"keys": "nope"}}
    assert _raw_call(pool.control, [msgpack.packb(head)]).record.code == "wrong_type"
    reply = await rpc.call(p.PoolGet(keys=[k0, 5]))
    assert reply.record == p.PoolBlocks(found=1) and [bytes(b) for b in reply.bulk] == [d0]
    assert pool.popen.poll() is None and pool.stats().block_bytes == BLOCK
    await rpc.close()
