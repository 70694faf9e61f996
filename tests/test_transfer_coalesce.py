"""Small chunks that ``send`` queues for one receiver and request go out as one BATCH at
the event loop's next turn (common/transfer/coalesce.py): counted here in messages the
receiver verified, with every byte, the order and the failure rules of chunks one by
one."""

from __future__ import annotations

import asyncio
import random
import secrets

import pytest

from common.transfer import TransferError, make_receiver, make_sender

TOKEN = secrets.token_bytes(16)


@pytest.fixture(params=["tcp", "shm"])
async def pair(request):
    got: list = []
    rx = make_receiver(request.param,
                       sink=lambda r, layer, b, p: got.append((r, layer, b, bytes(p))))
    await rx.start()
    tx = make_sender(request.param)
    messages: list[int] = []  # chunks per message the receiver verified
    on_batch, on_chunk = rx.table.on_batch, rx.table.on_chunk
    rx.table.on_batch = lambda m, *a: (messages.append(len(m.layers)), on_batch(m, *a))[1]
    rx.table.on_chunk = lambda *a: (messages.append(1), on_chunk(*a))[1]
    yield rx, tx, got, messages
    await tx.close()
    await rx.close()


def plan(rid: str, sizes: list[int]) -> list[tuple]:
    return [(rid, i, [i, 100 + i], random.Random(i).randbytes(n)) for i, n in enumerate(sizes)]


async def send_each(tx, address, chunks, *, turn: bool = False) -> None:
    for rid, layer, blocks, payload in chunks:
        await tx.send(address, rid, layer, blocks, payload, token=TOKEN)
        if turn:
            await asyncio.sleep(0)


async def test_a_requests_layers_sent_one_by_one_arrive_as_one_batch(pair):
    rx, tx, got, messages = pair
    chunks = plan("r", [48 << 10] * 30)  # 1.4 MiB: a few hundred tokens, a layer each
    transfer = rx.expect("r", lease_s=10, token=TOKEN)
    await send_each(tx, rx.address, chunks)
    assert tx._coalescer.busy  # queued: the FINISH must post them first
    await tx.finish(rx.address, "r", 30, token=TOKEN)
    assert not tx._coalescer.busy  # nothing left for a later flush to do
    await transfer.wait()
    assert got == chunks  # every byte, in the order sent
    assert messages == [30]  # one message, one verdict
    assert (transfer.chunks_received, transfer.bytes_received) == (30, 30 * (48 << 10))


async def test_chunks_a_turn_apart_go_one_by_one(pair):
    rx, tx, got, messages = pair
    chunks = plan("r", [1000] * 5)
    transfer = rx.expect("r", lease_s=10, token=TOKEN)
    await send_each(tx, rx.address, chunks, turn=True)
    await tx.finish(rx.address, "r", 5, token=TOKEN)
    await transfer.wait()
    assert got == chunks and messages == [1] * 5


async def test_a_queue_is_cut_at_the_batch_limits_and_a_large_chunk_keeps_its_place(pair):
    rx, tx, got, messages = pair
    # 130 tiny chunks (over the 128-chunk limit), then one of 1 MiB (goes alone, at
    # once), then 3 MiB of 512 KiB chunks and one more tiny one.
    chunks = plan("r", [10] * 130 + [1 << 20] + [512 << 10] * 6 + [10])
    transfer = rx.expect("r", lease_s=20, token=TOKEN)
    await send_each(tx, rx.address, chunks)
    await tx.finish(rx.address, "r", len(chunks), token=TOKEN)
    await transfer.wait()
    assert got == chunks
    assert messages == [128, 2, 1, 7]


async def test_requests_are_queued_apart_and_a_failed_ones_finish_raises_its_reason(pair):
    rx, tx, got, messages = pair
    good, bad = rx.expect("good", lease_s=10, token=TOKEN), rx.expect("bad", lease_s=10,
                                                                        token=TOKEN)
    rx.table._sink = lambda r, layer, b, p: (
        (_ for _ in ()).throw(ValueError("no room")) if r == "bad" else got.append(r))
    await send_each(tx, rx.address, plan("good", [100] * 3) + plan("bad", [100] * 3))
    await tx.finish(rx.address, "good", 3, token=TOKEN)
    await good.wait()
    with pytest.raises(TransferError, match="sink raised ValueError: no room"):
        await bad.wait()
    with pytest.raises(TransferError, match="no room"):  # its verdict, via its finish
        await tx.finish(rx.address, "bad", 3, token=TOKEN)
    assert got == ["good"] * 3 and sorted(messages) == [3, 3]


async def test_a_receiver_that_cannot_be_reached_fails_the_send_itself():
    tx = make_sender("tcp")
    try:
        with pytest.raises(TransferError, match="cannot connect"):
            await tx.send("tcp://127.0.0.1:1", "r", 0, [1], b"x" * 100, token=TOKEN)
    finally:
        await tx.close()


async def test_closing_with_chunks_queued_sends_none_of_them_and_raises_nothing(pair):
    rx, tx, got, messages = pair
    transfer = rx.expect("r", lease_s=10, token=TOKEN)
    await send_each(tx, rx.address, plan("r", [1000] * 4))
    await tx.close()  # before the loop's next turn: the queue is forgotten
    await asyncio.sleep(0.05)
    assert got == [] and messages == [] and transfer.chunks_received == 0
    rx.cancel("r")
