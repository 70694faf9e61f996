"""An idle ucx connection leaves the core alone: its waiting receives nap while no
transfer is expected and no verdict is due (``ucx.Pacer``), and wake at once when one
is, so the next transfer is still quick and byte-exact."""

from __future__ import annotations

import asyncio
import os
import secrets
import time

import pytest

from common.transfer import make_receiver, make_sender
from common.transfer.table import TransferTable
from common.transfer.ucx import IDLE_S, Pacer
from tests.ucx_probe import UCX_MISSING

TOKEN = secrets.token_bytes(16)


async def test_a_nap_lasts_its_interval_unless_woken_and_expect_wakes_it():
    pacer = Pacer(lambda: False)
    started = time.perf_counter()
    await pacer.nap()
    assert time.perf_counter() - started >= 0.9 * IDLE_S  # a timer, not a spin
    table = TransferTable(lambda *args: None)
    table.on_expect.append(pacer.wake)
    woken = []
    for _ in range(3):  # each expect ends the naps under way, and only those
        nap = asyncio.ensure_future(pacer.nap())
        await asyncio.sleep(0)
        table.expect(f"r{len(woken)}", lease_s=10, token=TOKEN)
        async with asyncio.timeout(IDLE_S / 2):  # well before its timer
            await nap
        woken.append(nap.done())
    assert woken == [True, True, True] and table.live() == 3
    table.cancel_all("test over")


@pytest.mark.skipif(UCX_MISSING is not None, reason=str(UCX_MISSING))
async def test_an_idle_ucx_pair_leaves_the_core_alone_and_wakes_for_the_next_transfer():
    got = []
    rx = make_receiver("ucx", sink=lambda r, layer, b, p: got.append((r, layer, b, bytes(p))))
    await rx.start()
    tx = make_sender("ucx")
    try:
        first = rx.expect("first", lease_s=30, token=TOKEN)
        await tx.send(rx.address, "first", 0, [1], b"x" * 4096, token=TOKEN)
        await tx.finish(rx.address, "first", 1, token=TOKEN)
        await first.wait()
        await asyncio.sleep(0.1)  # what the transfer left settles
        # Both ends idle, each with a receive posted (the receiver's next run, the
        # sender's verdicts): ucxx's default progress would poll them flat out.
        cpu, wall = time.process_time(), time.perf_counter()
        await asyncio.sleep(1.0)
        share = (time.process_time() - cpu) / (time.perf_counter() - wall)
        assert share < 0.3, f"an idle ucx sender and receiver used {share:.0%} of a core"
        # The next transfer is seen at once, not a nap later, and arrives exact.
        payload = os.urandom(100_000)
        after = rx.expect("after", lease_s=30, token=TOKEN)
        started = time.perf_counter()
        await tx.send(rx.address, "after", 3, [5, 9], payload, token=TOKEN)
        await tx.finish(rx.address, "after", 1, token=TOKEN)
        await after.wait()
        assert time.perf_counter() - started < 5.0  # generous: a loaded CI machine
        assert got[-1] == ("after", 3, [5, 9], payload) and after.chunks_received == 1
    finally:
        await tx.close()
        await rx.close()
    assert rx.table.on_expect == []  # a table shared with other receivers keeps no hook
