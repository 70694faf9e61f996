"""KV head slices on the data plane (wire version 6): each rank of a tensor-parallel
prefill worker sends its heads' slice of every layer on its own connection, under the
transfer's one token; the receiver places them, refuses a slice that overlaps one that
landed (or forges its token), and ends the transfer DONE only once every head of every
layer and block is in, on every backend (tcp, shm, and ucx where ucxx imports)."""

from __future__ import annotations

import asyncio
import secrets
import threading

import pytest

from common.transfer import TransferError, TransferState, make_sender, wire
from common.transfer.backends import backend_receiver
from common.transfer.slices import SliceLedger
from common.transfer.table import TransferTable
from tests.kv_sink import Sink
from tests.ucx_probe import UCX_MISSING

pytestmark = pytest.mark.timeout(60)


HEADS, BLOCKS, LAYERS = 4, [3, 5], 2


@pytest.fixture(params=["tcp", "shm", "ucx"])
def kind(request) -> str:
    if request.param == "ucx" and UCX_MISSING:
        pytest.skip(UCX_MISSING)
    return request.param


class SliceSink:
    def __init__(self) -> None:
        self.landed: list[tuple[str, int, list[int], tuple[int, int, int], bytes]] = []

    def __call__(self, rid, layer, block_ids, heads, payload) -> None:
        if rid == "small" and heads[0] + heads[1] > 3:  # a destination of 3 heads
            raise ValueError(f"head slice {heads} for a cache of 3 heads")
        self.landed.append((rid, layer, list(block_ids), heads, bytes(payload)))


@pytest.fixture
async def parts(kind):
    whole, slices = Sink(), SliceSink()
    rx = backend_receiver(kind, "127.0.0.1", 0, table=TransferTable(whole, slices))
    await rx.start()
    ranks = [make_sender(kind) for _ in range(2)]
    yield rx, whole, slices, ranks
    for tx in ranks:
        await tx.close()
    await rx.close()


def payload(layer: int, rank: int) -> bytes:
    return bytes([16 * layer + rank]) * 64


async def test_every_rank_sends_its_slice_and_done_waits_for_the_last(parts):
    rx, whole, slices, (rank0, rank1) = parts
    token = secrets.token_bytes(16)
    transfer = rx.expect("r", 10, token)
    # Rank 0 sends heads [0, 2) of every layer and its FINISH for all four chunks
    # before rank 1's slices come: the transfer waits for them.
    for layer in range(LAYERS):
        await rank0.send(rx.address, "r", layer, BLOCKS, payload(layer, 0), token=token,
                         heads=(0, 2, HEADS))
    await rank0.finish(rx.address, "r", 2 * LAYERS, token=token)
    await asyncio.sleep(0.1)
    assert transfer.state is TransferState.TRANSFERRING and transfer.chunks_received == 2
    await rank1.send(rx.address, "r", 0, BLOCKS, payload(0, 1), token=token,
                     heads=(2, 2, HEADS))
    await asyncio.sleep(0.05)
    assert transfer.is_live  # layer 1's heads [2, 4) are not in
    await rank1.send(rx.address, "r", 1, BLOCKS, payload(1, 1), token=token,
                     heads=(2, 2, HEADS))
    async with asyncio.timeout(5):
        await transfer.wait()
    assert transfer.bytes_received == 4 * 64  # each slice once
    assert sorted((layer, heads, data) for _, layer, _, heads, data in slices.landed) == [
        (layer, (start, 2, HEADS), payload(layer, start // 2))
        for layer in range(LAYERS) for start in (0, 2)]
    assert whole.chunks == []


async def test_a_slice_sent_twice_or_forged_is_refused_before_it_lands(parts):
    rx, _, slices, (rank0, rank1) = parts
    token = secrets.token_bytes(16)
    transfer = rx.expect("r", 10, token)
    await rank0.send(rx.address, "r", 0, BLOCKS, payload(0, 0), token=token,
                     heads=(0, 2, HEADS))
    # Another token: refused and counted, the transfer as it was.
    await rank1.send(rx.address, "r", 0, BLOCKS, payload(0, 9), token=b"x" * 16,
                     heads=(2, 2, HEADS))
    async with asyncio.timeout(5):
        while rx.refused < 1:
            await asyncio.sleep(0.01)
    assert transfer.is_live and len(slices.landed) == 1
    # Heads [1, 3) overlap heads [0, 2), which landed: the transfer fails, nothing written.
    with pytest.raises(TransferError):
        await rank1.send(rx.address, "r", 0, BLOCKS, payload(0, 1), token=token,
                         heads=(1, 2, HEADS))
        await rank1.finish(rx.address, "r", 2, token=token)
    with pytest.raises(TransferError, match="sent twice"):
        await transfer.wait()
    assert [heads for *_, heads, _ in slices.landed] == [(0, 2, HEADS)]


async def test_a_slice_outside_the_destination_heads_fails_the_transfer(parts):
    rx, _, slices, (rank0, _) = parts
    token = secrets.token_bytes(16)
    transfer = rx.expect("small", 10, token)
    with pytest.raises(TransferError):
        await rank0.send(rx.address, "small", 0, BLOCKS, payload(0, 0), token=token,
                         heads=(2, 2, HEADS))
        await rank0.finish(rx.address, "small", 1, token=token)
    with pytest.raises(TransferError, match="cache of 3 heads"):
        await transfer.wait()
    assert slices.landed == []


async def test_finish_with_every_chunk_but_a_head_missing_fails(parts):
    rx, _, _, (rank0, _) = parts
    token = secrets.token_bytes(16)
    transfer = rx.expect("r", 10, token)
    for layer in range(LAYERS):
        await rank0.send(rx.address, "r", layer, BLOCKS, payload(layer, 0), token=token,
                         heads=(0, 2, HEADS))
    await rank0.finish(rx.address, "r", 2, token=token)
    with pytest.raises(TransferError, match="has 2 of its 4 heads"):
        async with asyncio.timeout(5):
            await transfer.wait()


def test_wire_round_trips_the_head_slice_and_refuses_a_bad_one():
    chunk = wire.Chunk("r", 1, [2, 3], 7, 0, b"t", (2, 1, 3))
    raw = wire.encode(chunk, 10)
    kind, header_len, _ = wire.decode_prefix(raw[:wire.PREFIX.size])
    assert wire.decode_header(kind, raw[wire.PREFIX.size:]) == chunk
    assert wire.decode_chunk(wire.encode_chunk(chunk._replace(heads=wire.WHOLE))).heads \
        is wire.WHOLE
    for bad in ((2, 2, 3), (0, 0, 3), (1, 1)):
        with pytest.raises(wire.WireError, match="head"):
            wire.encode(chunk._replace(heads=bad), 10)
    tail = wire.encode_chunk(chunk)[wire.CHUNK_HEAD.size:]
    forged = wire.CHUNK_HEAD.pack(7, 1, 0, 1, 1, 2, 2, 2, 3) + tail
    with pytest.raises(wire.WireError, match=r"\[2, 4\) outside the 3 heads"):
        wire.decode_chunk(forged)


def test_ledger_counts_heads_per_layer_and_block():
    ledger = SliceLedger(3)
    assert ledger.refuse(0, [1, 1], (0, 1, 3)) == "head slice names a block twice: [1, 1]"
    assert ledger.refuse(0, [1], (0, 1, 2)) == "head slice of 2 heads in a transfer of 3"
    ledger.land(0, [1, 2], (0, 1, 3))
    ledger.land(0, [1, 2], (1, 2, 3))
    ledger.land(1, [1], (2, 1, 3))
    assert ledger.refuse(1, [1], (1, 2, 3)) == "heads [1, 3) of layer 1 block 1 sent twice"
    assert ledger.missing() == "layer 1 block 1 has 1 of its 3 heads"
    ledger.land(1, [1], (0, 2, 3))
    assert ledger.missing() is None


class _Cache:
    """A decode rank's KV cache, as ``FollowerReceiver`` writes into it."""

    def __init__(self) -> None:
        self.landed: list[tuple[int, list[int], tuple[int, int, int], bytes]] = []

    def import_layer_slice_bytes(self, layer, block_ids, heads, payload) -> None:
        self.landed.append((layer, list(block_ids), heads, bytes(payload)))


class _Store:
    """The group's TCPStore, as a follower's receiver uses it: set, delete_key."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.changed = threading.Condition()

    def set(self, key: str, value: bytes) -> None:
        with self.changed:
            self.values[key] = value
            self.changed.notify_all()

    def delete_key(self, key: str) -> None:
        self.values.pop(key, None)

    def wait_for(self, keys: list[str], timeout: float) -> list[bytes]:
        with self.changed:
            self.changed.wait_for(lambda: all(k in self.values for k in keys), timeout)
            return [self.values.get(k) for k in keys]


def head_bytes(layer: int, held: int, rows: int) -> bytes:
    """A layer's ``[rows, held heads, 8]`` bytes: each head's bytes name it and the layer."""
    return b"".join(bytes([16 * layer + h]) * 8 for _ in range(rows) for h in range(held))


def test_follower_ranks_send_and_take_their_slices_on_every_backend(kind):
    """The direct path off rank 0, on ``kind``: a prefill follower's ``DirectSender``
    (its own event loop thread) cuts every layer of its 4 heads into the slices of two
    decode followers' ``FollowerReceiver``s holding heads [0, 2) and [2, 4) (each its own
    thread too), as ``plan_targets`` says; rank 0 sends each receiver its FINISH. Each
    receiver writes its own heads' bytes, numbered as it holds them, and reports the
    bytes it took."""
    import msgpack

    from services.engine.tp_direct import DirectSender, plan_targets, split_heads
    from services.engine.tp_recv import ADVERT_KEY, FollowerReceiver, landed_key

    store, caches = _Store(), [_Cache(), _Cache()]
    receivers = [FollowerReceiver(cache, rank, store) for rank, cache in
                 zip((1, 2), caches, strict=True)]
    sender = DirectSender()
    try:
        addresses = []
        for rx in receivers:
            rx.listen([kind], "127.0.0.1", "host")
            endpoints = msgpack.unpackb(store.values[ADVERT_KEY.format(rank=rx.rank)])
            addresses.append(endpoints[kind])
        token, blocks, rows = secrets.token_bytes(16), [3, 5], 2 * 2 * 4
        for rx in receivers:
            rx.expect("r", token, 10.0, blocks)
        targets = plan_targets([(0, 4, 4)], [(addresses[0], 0, 2), (addresses[1], 2, 2)])
        assert targets == [(0, addresses[0], 0, 2, (0, 2, 2)),
                           (0, addresses[1], 2, 2, (0, 2, 2))]
        for layer in range(LAYERS):
            whole = memoryview(head_bytes(layer, 4, rows))
            for _, address, first, count, heads in targets:
                sender.send(address, "r", layer, blocks,
                            split_heads(whole, 4, first, count, rows), token, heads)

        # Rank 0's FINISH to each receiver, on a connection of its own, from a loop that
        # lives on (as a worker's does) until the receivers report.
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True).start()
        rank0 = make_sender(kind)

        async def finish() -> None:
            for address in addresses:
                await rank0.finish(address, "r", LAYERS, token=token)

        try:
            asyncio.run_coroutine_threadsafe(finish(), loop).result(20)
            keys = [landed_key("r", token, rx.rank) for rx in receivers]
            reports = store.wait_for(keys, 20.0)
        finally:
            asyncio.run_coroutine_threadsafe(rank0.close(), loop).result(20)
            loop.call_soon_threadsafe(loop.stop)
        half = LAYERS * rows * 2 * 8  # two heads of every layer
        assert reports == [b"ok %d" % half] * 2
        assert sender.sent_bytes == 2 * half and sender.failed == 0
        for cache, first in zip(caches, (0, 2), strict=True):
            want = [(layer, blocks, (0, 2, 2),
                     b"".join(bytes([16 * layer + first + h]) * 8
                              for _ in range(rows) for h in range(2)))
                    for layer in range(LAYERS)]
            assert sorted(cache.landed) == want
    finally:
        sender.close()
        for rx in receivers:
            rx.close()
