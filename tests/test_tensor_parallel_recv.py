"""A tensor-parallel decode follower's receiver (services/engine/tp_recv.py), one piece at
a time: an Abort that runs while the followers are being told to expect a transfer
leaves no expectation behind on them, a stale drop spares a newer transfer, and the
test-only refusal switch is thrown only by a file naming the rank."""

from __future__ import annotations

import asyncio
import types
from datetime import timedelta

import pytest

from services.engine.tp_recv import (
    FAIL_ENV,
    KV_DROP,
    KV_EXPECT,
    FollowerReceiver,
    LeaderReceive,
    landed_key,
    refuses,
    )
from services.worker.decode_ranks import drop_ranks, expect_ranks
from tests.ucx_probe import UCX_MISSING

RID, TOKEN, BLOCKS = "req-1", b"t" * 16, [3, 4, 5]


@pytest.fixture
def follower():
    """Rank 1's receiver on tcp, its plans delivered as tp_follower.py does."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=10))
    receiver = FollowerReceiver(cache=None, rank=1, store=store)
    receiver.listen(["tcp"], "127.0.0.1", "host-a")
    yield receiver, store
    receiver.close()


def leader_of(receiver, store, plans: list[int]) -> LeaderReceive:
    def send_plan(payload: bytes, kind: int) -> None:
        plans.append(kind)
        receiver.apply(kind, payload)
    return LeaderReceive(store, store.port, 2, send_plan)


class Engine:
    def __init__(self, receive) -> None:
        self.kv_store = types.SimpleNamespace(receive=receive)
        self.aborted: list[str] = []

    def abort(self, rid: str) -> bool:
        self.aborted.append(rid)
        return True


def role_of(engine: Engine, abort_during_expect: bool):
    """A decode role as ``expect_ranks`` sees it; its engine calls run in order, and an
    Abort (the stream forgotten, as ``DecodeRole.abort`` does) may run during the first."""
    role = types.SimpleNamespace(streams={RID: object()}, calls=0)

    async def run(fn, *args):
        result = fn(engine, *args)
        role.calls += 1
        if abort_during_expect and role.calls == 1:
            role.streams.pop(RID)
            engine.abort(RID)
        return result

    role.ctx = types.SimpleNamespace(settings=types.SimpleNamespace(kv_lease_s=5.0),
                                     loop=types.SimpleNamespace(run=run))
    return role


SLOTS = types.SimpleNamespace(block_ids=[1, 2, *BLOCKS], num_cached_blocks=2)


async def test_an_abort_during_the_followers_expect_drops_their_entry_at_once(follower):
    receiver, store = follower
    plans: list[int] = []
    engine = Engine(leader_of(receiver, store, plans))
    role = role_of(engine, abort_during_expect=True)
    assert not await expect_ranks(role, RID, role.streams[RID], TOKEN, SLOTS)
    assert plans == [KV_EXPECT, KV_DROP]
    assert RID not in receiver._expected
    assert receiver._receiver.live() == 0  # cancelled, not waiting for its lease
    assert engine.aborted == [RID, RID]  # the Abort's own, then admission's: harmless
    assert not store.check([landed_key(RID, TOKEN, 1)])


async def test_expected_without_an_abort_and_only_the_right_token_drops_it(follower):
    receiver, store = follower
    plans: list[int] = []
    engine = Engine(leader_of(receiver, store, plans))
    role = role_of(engine, abort_during_expect=False)
    assert await expect_ranks(role, RID, role.streams[RID], TOKEN, SLOTS)
    assert plans == [KV_EXPECT] and engine.aborted == []
    assert receiver._expected[RID][:2] == (TOKEN, BLOCKS)
    assert receiver._receiver.live() == 1
    drop_ranks(engine, RID, b"s" * 16)  # an older transfer's: this one stays
    assert RID in receiver._expected and receiver._receiver.live() == 1
    drop_ranks(engine, RID, TOKEN)
    assert RID not in receiver._expected and receiver._receiver.live() == 0
    assert plans == [KV_EXPECT, KV_DROP, KV_DROP]


def test_the_refusal_switch_needs_a_file_naming_the_rank(tmp_path, monkeypatch):
    monkeypatch.delenv(FAIL_ENV, raising=False)
    assert not refuses(1)
    monkeypatch.setenv(FAIL_ENV, "1")  # a bare number is no file: nothing refused
    assert not refuses(1)
    switch = tmp_path / "refuse"
    monkeypatch.setenv(FAIL_ENV, str(switch))
    assert not refuses(1)
    switch.write_text("1\n")
    assert refuses(1) and not refuses(0)
    switch.write_text("")
    assert not refuses(1)


@pytest.mark.parametrize("kind", ["tcp", "shm", pytest.param("ucx", marks=pytest.mark.skipif(
    UCX_MISSING is not None, reason=f"{UCX_MISSING}"))])
async def test_a_finish_before_the_first_slice_waits_for_the_slices(kind):
    """A decode rank whose heads a prefill follower holds gets its FINISH from prefill
    rank 0, which sent it nothing: the FINISH may come first, and must wait."""
    import secrets

    from common.transfer import TransferState, make_sender
    from common.transfer.backends import backend_receiver
    from common.transfer.table import TransferTable
    from tests.kv_sink import Sink

    landed = []
    rx = backend_receiver(kind, "127.0.0.1", 0, table=TransferTable(
        Sink(), lambda rid, layer, block_ids, heads, payload: landed.append((layer, heads))))
    await rx.start()
    rank0, rank1 = make_sender(kind), make_sender(kind)
    try:
        token = secrets.token_bytes(16)
        transfer = rx.expect("r", 10, token)
        finishing = asyncio.create_task(rank0.finish(rx.address, "r", 2, token=token))
        await asyncio.sleep(0.1)
        assert transfer.is_live and transfer.chunks_received == 0
        for layer in range(2):
            await rank1.send(rx.address, "r", layer, BLOCKS, bytes([layer]) * 64,
                             token=token, heads=(0, 1, 1))
        async with asyncio.timeout(10):
            await transfer.wait()
            await finishing
        assert transfer.state is TransferState.DONE and transfer.bytes_received == 128
        assert landed == [(0, (0, 1, 1)), (1, (0, 1, 1))]
    finally:
        for tx in (rank0, rank1):
            await tx.close()
        await rx.close()
