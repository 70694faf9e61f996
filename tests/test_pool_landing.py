"""Pool transfers land in reused memory: an arena comes back only once no block of it is
held, so held blocks never change; arenas over the kept limit are let go; a real get
over the data plane returns the right bytes into an arena it reuses; and the pool lands
puts, and packs the copies a get sends, in arenas of its own."""

from __future__ import annotations

import gc

import pytest

from common.pool.client import PoolClient
from common.pool.landing import PAGE, LandingArenas, Packer
from common.pool.transfer import BlockInbox
from tests.pool_procs import BLOCK, blocks, in_process_pool

pytestmark = pytest.mark.timeout(60)


def test_an_arena_is_reused_only_once_no_view_of_it_is_left():
    arenas = LandingArenas(keep_bytes=1 << 20)
    first = arenas.take(3 * PAGE)
    first[:] = b"a" * len(first)
    slice_of_slice = memoryview(first[PAGE:])[:10]  # views of views hold it too
    del first
    second = arenas.take(3 * PAGE)  # the first is still viewed: a new one
    assert (arenas.made, arenas.reused) == (2, 0)
    second[:] = b"b" * len(second)
    assert bytes(slice_of_slice) == b"a" * 10  # untouched by the second take
    del slice_of_slice
    third = arenas.take(2 * PAGE)  # fits the first, idle now, and keeps its old bytes
    assert (arenas.made, arenas.reused) == (2, 1)
    assert bytes(third[:4]) == b"aaaa"
    del second, third
    gc.collect()
    assert arenas.kept_bytes == 6 * PAGE


def test_arenas_beyond_the_kept_bytes_are_let_go():
    arenas = LandingArenas(keep_bytes=4 * PAGE)
    a = arenas.take(3 * PAGE)
    b = arenas.take(3 * PAGE)  # a is held: forgotten, not unmapped (a still reads)
    a[:1] = b"x"
    assert bytes(a[:1]) == b"x" and arenas.kept_bytes == 3 * PAGE
    del a, b
    big = arenas.take(10 * PAGE)  # larger than kept: served, never kept
    big[-1:] = b"y"
    assert arenas.kept_bytes == 0 and arenas.made == 3
    with pytest.raises(ValueError):
        arenas.take(0)
    with pytest.raises(MemoryError):
        arenas.take(1 << 62)


def test_a_packer_copies_back_to_back_then_falls_back_to_bytes():
    arenas = LandingArenas()
    Packer(arenas, 100)
    assert arenas.made == 0  # nothing taken until it copies
    pack = Packer(arenas, 10)
    a, b = pack(memoryview(b"abcd")), pack(memoryview(b"efgh"))
    c = pack(memoryview(b"ijk"))  # 11 bytes would not fit in 10
    assert (bytes(a), bytes(b), bytes(c)) == (b"abcd", b"efgh", b"ijk")
    assert isinstance(a, memoryview) and isinstance(c, bytes)
    assert a.obj is b.obj and arenas.made == 1  # one arena, back to back
    assert bytes(memoryview(a.obj)[:8]) == b"abcdefgh"
    assert bytes(Packer(arenas, 0)(memoryview(b"xy"))) == b"xy"


class _Receiver:
    """The one KVReceiver call ``BlockInbox.open`` makes."""

    def expect(self, request_id, lease_s, token):
        return (request_id, token)


def _open(inbox: BlockInbox, tid: str, count: int) -> None:
    inbox.open(_Receiver(), tid, count, 0, 5.0)


def test_an_inbox_with_arenas_lands_each_transfer_apart_and_checks_as_before():
    inbox = BlockInbox(LandingArenas())
    data = [bytes([i]) * 100 for i in range(4)]
    _open(inbox, "t1", 4)
    inbox.sink("t1", 0, [2, 3], memoryview(data[2] + data[3]))  # two blocks in one chunk
    inbox.sink("t1", 0, [0], memoryview(data[0]))
    inbox.sink("t1", 0, [1], memoryview(data[1]))
    got = inbox.take("t1", 4)
    assert [bytes(b) for b in got] == data and all(isinstance(b, memoryview) for b in got)

    _open(inbox, "t2", 2)  # t1's blocks are held: t2 lands elsewhere
    inbox.sink("t2", 0, [0, 1], memoryview(b"\xee" * 200))
    assert [bytes(b) for b in got] == data
    assert [bytes(b) for b in inbox.take("t2", 2)] == [b"\xee" * 100] * 2
    assert inbox.arenas.made == 2

    _open(inbox, "t3", 3)
    inbox.sink("t3", 0, [0], memoryview(b"\x01" * 50))
    with pytest.raises(ValueError, match="blocks of 100 bytes"):
        inbox.sink("t3", 0, [1], memoryview(b"\x01" * 100))
    with pytest.raises(ValueError, match="out of range or sent twice"):
        inbox.sink("t3", 0, [0], memoryview(b"\x01" * 50))
    with pytest.raises(ValueError, match="out of range or sent twice"):
        inbox.sink("t3", 0, [3], memoryview(b"\x01" * 50))
    with pytest.raises(ValueError, match="sent twice in one chunk"):
        inbox.sink("t3", 0, [1, 1], memoryview(b"\x01" * 100))
    with pytest.raises(ValueError, match="cannot hold"):
        inbox.sink("t3", 0, [1], memoryview(b""))
    assert inbox.take("t3", 3) is None  # two blocks never came
    assert (inbox.arenas.made, inbox.arenas.reused) == (2, 1)  # t2's: nothing held it
    del got
    _open(inbox, "t4", 1)  # t1's arena is idle again too
    inbox.sink("t4", 0, [0], memoryview(b"z" * 64))
    assert (inbox.arenas.made, inbox.arenas.reused) == (2, 2)
    inbox.discard("t4")
    assert len(inbox) == 0


async def test_gets_over_the_data_plane_reuse_the_memory_they_land_in(ctx, pools):
    pool = pools().start()
    client = PoolClient(ctx, {"a": pool.control}, transfer_backend="tcp", timeout_s=5.0)
    chain = blocks(12, size=BLOCK)
    keys, data = [k for k, _, _ in chain], [d for _, d, _ in chain]
    try:
        assert await client.put(chain) == 12
        held = await client.get(keys)
        assert [bytes(b) for b in held] == data
        again = await client.get(keys[6:])  # held is held: another arena
        assert [bytes(b) for b in again] == data[6:]
        arenas = client.inbox.arenas
        assert (arenas.made, arenas.reused) == (2, 0)
        del held, again
        for _ in range(3):
            assert [bytes(b) for b in await client.get(keys)] == data
        assert (arenas.made, arenas.reused) == (2, 3)
        assert client.receiver.live() == 0 and len(client.inbox) == 0
    finally:
        await client.close()
    assert arenas.kept_bytes == 0



async def test_the_pool_lands_puts_in_arenas_it_reuses_and_stores_copies(ctx):
    async with in_process_pool() as pool:
        client = PoolClient(ctx, {"a": pool.settings.control_addr}, timeout_s=5.0)
        chains = [blocks(8, seed=s) for s in range(3)]
        try:
            for chain in chains:
                assert await client.put(chain) == 8
            arenas = pool.data_plane.inbox.arenas
            assert (arenas.made, arenas.reused) == (1, 2)  # one arena, refilled per put
            for chain in chains:  # each put's bytes were copied out before the next landed
                assert [bytes(b) for b in await client.get([k for k, _, _ in chain])] == \
                    [d for _, d, _ in chain]
            # Each get's copies out of DRAM went to an arena too: that arena again, or a
            # second one while a send still held the one before.
            assert arenas.made + arenas.reused == 6 and arenas.made <= 2
            assert await client.get([7]) == []  # nothing held: no arena taken
            assert arenas.made + arenas.reused == 6
        finally:
            await client.close()
    assert arenas.kept_bytes == 0
