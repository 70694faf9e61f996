"""Cache-pool block bytes on the data plane: byte-exact round trips per backend with the
bytes counted on the data plane and none in ZeroMQ frames, broken transfers as misses and
failed writes, and no transfer left behind on either end after any of them."""

from __future__ import annotations

import asyncio

import pytest

from common import protocol as p
from common.pool.client import PoolClient
from common.pool.data_plane import DataPlaneCarrier
from common.pool.frames import FrameCarrier
from common.transfer import MultiSender, TransferError
from common.transfer.negotiate import available_backends
from common.zmq_rpc import RemoteError, RpcClient
from services.cache_pool.server import CachePool
from services.cache_pool.settings import PoolSettings
from tests.cluster import free_port
from tests.pool_procs import BLOCK, blocks, in_process_pool

pytestmark = pytest.mark.timeout(60)


def _ucx_works() -> bool:
    if "ucx" not in available_backends():
        return False
    try:
        from common.transfer.ucx_receiver import UcxReceiver  # noqa: F401
    except ImportError:
        return False
    return True


BACKENDS = ["tcp", "shm", pytest.param("ucx", marks=pytest.mark.skipif(
    not _ucx_works(), reason="ucxx is not usable here"))]


def assert_client_idle(client: PoolClient) -> None:
    assert client.receiver is None or client.receiver.live() == 0
    assert len(client.inbox) == 0


def assert_pool_idle(stats: dict) -> None:
    assert (stats.live_transfers, stats.pending_puts, stats.sending_gets) == (0, 0, 0)


async def until(pred, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not pred():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


# -- a real pool process, each backend forced ----------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
async def test_round_trip_moves_every_byte_on_the_data_plane(ctx, pools, backend):
    pool = pools().start()
    client = PoolClient(ctx, {"a": pool.control}, transfer_backend=backend, timeout_s=5.0)
    chain = blocks(20)
    keys, data = [k for k, _, _ in chain], [d for _, d, _ in chain]
    try:
        assert await client.put(chain) == 20
        assert await client.get(keys) == data
        assert await client.get(keys[:5] + [7] + keys[6:]) == data[:5]
        assert await client.get([7]) == []  # found 0: nothing sent, nothing left expected
        assert client.receiver.advert().endpoints.keys() == {backend}
        n = 25 * BLOCK
        assert client.counts == {"transfers": 3, "transfer_out_bytes": 20 * BLOCK,
                                 "transfer_in_bytes": n, f"backend_{backend}": 1}
        stats = pool.stats()
        assert stats.transfers == {"in_ok": 1, "in_bytes": 20 * BLOCK, "out_ok": 2,
                                      "out_bytes": n, f"out_{backend}": 2}
        assert stats.dram_blocks == 20
        assert_client_idle(client)
        assert_pool_idle(stats)
    finally:
        await client.close()


async def test_the_transport_picks_one_carrier_when_the_client_is_made(ctx):
    frames = PoolClient(ctx, {"a": f"tcp://127.0.0.1:{free_port()}"}, transport="zmq")
    plane = PoolClient(ctx, {"a": f"tcp://127.0.0.1:{free_port()}"}, transfer_backend="tcp")
    try:
        assert type(frames.carrier) is FrameCarrier
        assert (frames.receiver, frames.inbox) == (None, None)
        assert type(plane.carrier) is DataPlaneCarrier and len(plane.inbox) == 0
        assert plane.carrier.sender.forced == "tcp"
    finally:
        await frames.close()
        await plane.close()
    with pytest.raises(ValueError, match="transport"):
        PoolClient(ctx, {"a": "tcp://127.0.0.1:1"}, transport="carrier pigeon")


async def test_auto_negotiates_shm_on_one_host_and_zmq_transport_uses_frames(ctx, pools):
    pool = pools().start()
    auto = PoolClient(ctx, {"a": pool.control})
    frames = PoolClient(ctx, {"a": pool.control}, transport="zmq")
    chain, more = blocks(6), blocks(4, seed=1)
    try:
        assert await auto.put(chain) == 6
        assert await frames.put(more) == 4
        assert await frames.get([k for k, _, _ in chain]) == [d for _, d, _ in chain]
        assert await auto.get([k for k, _, _ in more]) == [d for _, d, _ in more]
        assert auto.counts == {"transfers": 2, "transfer_out_bytes": 6 * BLOCK,
                               "transfer_in_bytes": 4 * BLOCK, "backend_shm": 1}
        assert frames.counts == {"frame_out_bytes": 4 * BLOCK, "frame_in_bytes": 6 * BLOCK}
        assert frames.receiver is None  # no listener at all on the zmq transport
        transfers = pool.stats().transfers
        assert transfers == {"in_ok": 1, "in_bytes": 6 * BLOCK, "out_ok": 1,
                             "out_bytes": 4 * BLOCK, "out_shm": 1,
                             "frame_in_bytes": 4 * BLOCK, "frame_out_bytes": 6 * BLOCK}
    finally:
        await auto.close()
        await frames.close()


async def test_data_plane_requests_carry_no_bulk_frames(ctx, pools):
    """On the wire: PoolPut/PoolCommit/PoolBlocks of the data plane are bare records."""
    pool = pools().start()
    rpc = RpcClient(ctx, pool.control, name="test")
    [(k0, d0, _)] = blocks(1)
    sender = MultiSender()
    try:
        ready = await rpc.call(p.PoolPut(keys=[k0], depths=[0], block_bytes=BLOCK,
                                         transfer_id="t-1", lease_s=5.0))
        assert isinstance(ready.record, p.PoolReady) and len(ready.bulk) == 0
        assert ready.record.kv_advert == pool.stats().kv_advert
        address = sender.address_for(ready.record.kv_advert)
        token = ready.record.kv_token
        assert len(token) == 16
        # Anyone may reach the data-plane port; without the token a block is not taken.
        await sender.send(address, "t-1", 0, [0], bytes(len(d0)), token=b"")
        await sender.finish(address, "t-1", 1, token=token[::-1])
        await sender.send(address, "t-1", 0, [0], d0, token=token)
        await sender.finish(address, "t-1", 1, token=token)
        done = await rpc.call(p.PoolCommit(transfer_id="t-1"))
        assert done.record == p.Ack(detail="1") and len(done.bulk) == 0
        with pytest.raises(RemoteError, match="not_found"):  # an outcome is told once
            await rpc.call(p.PoolCommit(transfer_id="t-1"))
        with pytest.raises(RemoteError, match="bad_request"):  # frames and a transfer id
            await rpc.call(p.PoolPut(keys=[k0], depths=[0], block_bytes=BLOCK,
                                     transfer_id="t-2", lease_s=5.0), bulk=[d0])
        with pytest.raises(RemoteError, match="bad_request"):
            await rpc.call(p.PoolPut(keys=[k0], depths=[0], block_bytes=BLOCK,
                                     transfer_id="t-3", lease_s=0.0))
        with pytest.raises(RemoteError, match="bad_request"):  # an advert nobody can use
            await rpc.call(p.PoolGet(keys=[k0], transfer_id="t-4", lease_s=5.0,
                                     kv_advert=p.KVAdvert(host_id="h", endpoints={})))
        assert_pool_idle(pool.stats())
    finally:
        await sender.close()
        await rpc.close()


# -- an in-process pool, to break transfers on purpose --------------------------------------

class Flaky:
    """Wraps a sender: after ``good`` chunks, ``mode`` "raise" fails every call,
    "hang" never returns, "repeat" sends block 0 in place of the rest."""

    def __init__(self, inner, good: int, mode: str) -> None:
        self.inner, self.good, self.mode, self.sent = inner, good, mode, 0

    async def send(self, address, rid, layer, block_ids, payload, *, token=b""):
        self.sent += 1
        if self.sent > self.good:
            if self.mode == "raise":
                raise TransferError("injected failure", rid)
            if self.mode == "hang":
                await asyncio.Event().wait()
            block_ids = [0]
        await self.inner.send(address, rid, layer, block_ids, payload, token=token)

    def __getattr__(self, name):
        return getattr(self.inner, name)


LEASE_S = 2.0  # the clients' timeout_s, so every transfer's lease


@pytest.fixture
async def pool():
    async with in_process_pool() as instance:
        yield instance


def pool_stats(pool: CachePool) -> dict:
    return pool._stats(p.GetStats(), [])


@pytest.mark.parametrize("mode", ["raise", "hang", "repeat"])
async def test_a_get_broken_mid_transfer_is_a_miss(ctx, pool, mode):
    client = PoolClient(ctx, {"a": pool.settings.control_addr}, timeout_s=LEASE_S,
                        transfer_backend="tcp")
    chain = blocks(12)
    keys, data = [k for k, _, _ in chain], [d for _, d, _ in chain]
    try:
        assert await client.put(chain) == 12
        real = pool.data_plane.sender
        pool.data_plane.sender = Flaky(real, good=5, mode=mode)
        started = asyncio.get_running_loop().time()
        assert await client.get(keys) == []
        elapsed = asyncio.get_running_loop().time() - started
        if mode == "hang":  # nothing more arrives: the lease ends it
            assert LEASE_S - 0.1 < elapsed < LEASE_S + 2.5
        else:  # the failure reached the client at once
            assert elapsed < LEASE_S / 2
        assert client.counts["transfers_failed"] == 1
        await until(lambda: pool_stats(pool).sending_gets == 0)
        assert pool.transfers["out_failed"] == 1  # "repeat": the client failed it
        assert_client_idle(client)
        assert_pool_idle(pool_stats(pool))
        pool.data_plane.sender = real
        assert await client.get(keys) == data  # and the next one works
        assert_client_idle(client)
    finally:
        await client.close()


@pytest.mark.parametrize("mode", ["raise", "hang", "repeat"])
async def test_a_put_broken_mid_transfer_stores_nothing(ctx, pool, mode):
    client = PoolClient(ctx, {"a": pool.settings.control_addr}, timeout_s=1.0,
                        transfer_backend="tcp")
    chain = blocks(12)
    keys = [k for k, _, _ in chain]
    try:
        client.carrier.sender = Flaky(client.carrier.sender, good=5, mode=mode)
        assert await client.put(chain) == 0
        assert client.counts["transfers_failed"] == 1
        assert await client.exists(keys) == 0  # all or nothing: no prefix was stored
        assert pool.transfers["in_failed"] == 1 and pool.store.stats().dram_blocks == 0
        await until(lambda: pool_stats(pool).pending_puts == 0)
        assert_pool_idle(pool_stats(pool))
        client.carrier.sender = client.carrier.sender.inner
        assert await client.put(chain) == 12
        assert await client.exists(keys) == 12
        assert_pool_idle(pool_stats(pool))
    finally:
        await client.close()


async def test_a_client_that_vanishes_mid_put_costs_the_pool_one_lease(ctx, pool):
    rpc = RpcClient(ctx, pool.settings.control_addr, name="test")
    sender = MultiSender()
    chain = blocks(5)
    try:
        ready = await rpc.call(p.PoolPut(keys=[k for k, _, _ in chain], depths=list(range(5)),
                                         block_bytes=BLOCK, transfer_id="gone", lease_s=0.3))
        address = sender.address_for(ready.record.kv_advert)
        for i, (_, data, _) in enumerate(chain[:2]):
            await sender.send(address, "gone", 0, [i], data, token=ready.record.kv_token)
        assert pool_stats(pool).live_transfers == 1 and len(pool.data_plane.inbox) == 1
        # The lease ended it; nothing stored.
        await until(lambda: pool.data_plane.receiver.live() == 0)
        assert len(pool.data_plane.inbox) == 0 and pool.store.stats().dram_blocks == 0
        await until(lambda: not pool.data_plane.puts, timeout_s=2.0)  # its outcome, kept one lease
        assert_pool_idle(pool_stats(pool))
        with pytest.raises(RemoteError, match="not_found"):
            await rpc.call(p.PoolCommit(transfer_id="gone"))
    finally:
        await sender.close()
        await rpc.close()


async def test_a_pool_listening_on_every_interface_is_reached_by_its_control_host(ctx):
    settings = PoolSettings(control_addr=f"tcp://127.0.0.1:{free_port()}",
                            events_addr=f"tcp://127.0.0.1:{free_port()}",
                            dram_mib=64 * BLOCK / (1 << 20), block_bytes=BLOCK,
                            log_format="console", transfer_backend="tcp", kv_host="0.0.0.0")
    pool = CachePool(settings)
    await pool.start()
    client = PoolClient(ctx, {"a": settings.control_addr}, transfer_backend="tcp")
    chain = blocks(3)
    try:
        [(kind, address)] = pool.data_plane.receiver.advert().endpoints.items()
        assert address.startswith("tcp://0.0.0.0:")
        assert await client.put(chain) == 3
        assert client.carrier._put_addrs["a"][1] == address.replace("0.0.0.0", "127.0.0.1")
        assert await client.get([k for k, _, _ in chain]) == [d for _, d, _ in chain]
    finally:
        await client.close()
        await pool.close()
